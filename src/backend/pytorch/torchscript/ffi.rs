//! The C ABI of ferry's TorchScript shim (`shim.cpp`, compiled against the PyTorch the server
//! runs): load a module, read `forward`'s arguments, run it, read what it returned.
use std::{
    ffi::{CStr, CString, c_char, c_void},
    path::Path,
    sync::Arc,
};

use crate::backend::library::symbol;

/// An input or an output as the shim passes it (`fts_tensor` in shim.cpp).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RawTensor {
    pub dtype: i32,
    pub ndim: i32,
    pub shape: *const i64,
    pub data: *mut c_void,
    pub nbytes: i64,
    pub is_strings: i32,
    pub count: i64,
    pub strings: *const *const c_char,
    pub lengths: *const i64,
}

impl Default for RawTensor {
    fn default() -> Self {
        RawTensor {
            dtype: 0,
            ndim: 0,
            shape: std::ptr::null(),
            data: std::ptr::null_mut(),
            nbytes: 0,
            is_strings: 0,
            count: 0,
            strings: std::ptr::null(),
            lengths: std::ptr::null(),
        }
    }
}

type Run = unsafe extern "C" fn(
    *mut c_void,
    *const RawTensor,
    i32,
    *const RawTensor,
    *const *const c_char,
    i32,
    i32,
    i32,
    *mut *mut c_char,
) -> *mut c_void;

pub struct Shim {
    load: unsafe extern "C" fn(*const c_char, *mut *mut c_char) -> *mut c_void,
    share: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> *mut c_void,
    faulting_ops: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> *mut c_char,
    free: unsafe extern "C" fn(*mut c_void),
    argument: unsafe extern "C" fn(*mut c_void, i32, *mut *const c_char, *mut i32) -> i32,
    run: Run,
    count: unsafe extern "C" fn(*mut c_void) -> i32,
    keyed: unsafe extern "C" fn(*mut c_void) -> i32,
    output: unsafe extern "C" fn(*mut c_void, i32, *mut *const c_char, *mut RawTensor) -> i32,
    result_free: unsafe extern "C" fn(*mut c_void),
    free_string: unsafe extern "C" fn(*mut c_char),
    _library: libloading::Library,
}

// SAFETY: the shim's calls are safe from any thread (a module's forward may run concurrently).
unsafe impl Send for Shim {}
unsafe impl Sync for Shim {}

impl Shim {
    /// Loads the compiled shim; PyTorch must be loaded already (the shim needs it by name).
    pub fn load(path: &Path) -> Result<Shim, String> {
        // SAFETY: the shim's initializers are the C++ runtime's and PyTorch's headers'.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load the TorchScript shim '{}': {e}", path.display()))?;
        Ok(Shim {
            load: symbol!(lib, "TorchScript shim", "fts_load"),
            share: symbol!(lib, "TorchScript shim", "fts_share"),
            faulting_ops: symbol!(lib, "TorchScript shim", "fts_faulting_ops"),
            free: symbol!(lib, "TorchScript shim", "fts_free"),
            argument: symbol!(lib, "TorchScript shim", "fts_argument"),
            run: symbol!(lib, "TorchScript shim", "fts_run"),
            count: symbol!(lib, "TorchScript shim", "fts_result_count"),
            keyed: symbol!(lib, "TorchScript shim", "fts_result_keyed"),
            output: symbol!(lib, "TorchScript shim", "fts_result_output"),
            result_free: symbol!(lib, "TorchScript shim", "fts_result_free"),
            free_string: symbol!(lib, "TorchScript shim", "fts_free_string"),
            _library: lib,
        })
    }

    /// A string the shim allocated (a message), as text (freed).
    fn message(&self, err: *mut c_char) -> String {
        if err.is_null() {
            return "an unknown error".into();
        }
        // SAFETY: a NUL-terminated string the shim allocated, freed once here.
        let text = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
        // SAFETY: as above.
        unsafe { (self.free_string)(err) };
        let end = text.char_indices().nth(2000).map_or(text.len(), |(i, _)| i);
        text[..end].trim_end().to_string()
    }
}

/// A loaded TorchScript module (keeping the shim loaded, and the module it shares weights with).
pub struct Module {
    shim: Arc<Shim>,
    handle: *mut c_void,
    _base: Option<Arc<Module>>,
}

// SAFETY: a module's forward may run from any thread, and concurrently (TorchScript's interpreter
// keeps no per-call state in the module).
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

/// One of forward's arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Argument {
    pub name: String,
    pub required: bool,
}

impl Module {
    pub fn load(shim: Arc<Shim>, path: &Path) -> Result<Module, String> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "a path holds a NUL byte".to_string())?;
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: fts_load(path, err*) as shim.cpp defines it.
        let handle = unsafe { (shim.load)(c.as_ptr(), &mut err) };
        if handle.is_null() {
            return Err(shim.message(err));
        }
        Ok(Module { shim, handle, _base: None })
    }

    /// Another module over the same parameters and buffers, with attribute slots of its own.
    pub fn share(&self) -> Result<Module, String> {
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: fts_share(model, err*) as shim.cpp defines it.
        let handle = unsafe { (self.shim.share)(self.handle, &mut err) };
        if handle.is_null() {
            return Err(self.shim.message(err));
        }
        Ok(Module { shim: Arc::clone(&self.shim), handle, _base: None })
    }

    /// This module, keeping `base` (whose parameters it shares) alive while it lives.
    pub fn keeping(mut self, base: Arc<Module>) -> Module {
        self._base = Some(base);
        self
    }

    /// The operators in forward that can fault on integer values (empty: none).
    pub fn faulting_ops(&self) -> Result<String, String> {
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: fts_faulting_ops(model, err*) returns a string the shim allocated, or null.
        let found = unsafe { (self.shim.faulting_ops)(self.handle, &mut err) };
        if found.is_null() {
            return Err(self.shim.message(err));
        }
        Ok(self.shim.message(found))
    }

    pub fn arguments(&self) -> Result<Vec<Argument>, String> {
        let (mut name, mut required): (*const c_char, i32) = (std::ptr::null(), 0);
        // SAFETY: a negative index asks for the count only.
        let count = unsafe { (self.shim.argument)(self.handle, -1, &mut name, &mut required) };
        if count < 0 {
            return Err("cannot read the model's forward arguments".into());
        }
        (0..count)
            .map(|i| {
                // SAFETY: the name is the module's, valid while it lives; copied here.
                unsafe {
                    (self.shim.argument)(self.handle, i, &mut name, &mut required);
                    if name.is_null() {
                        return Err("cannot read the model's forward arguments".into());
                    }
                    Ok(Argument { name: CStr::from_ptr(name).to_string_lossy().into_owned(), required: required != 0 })
                }
            })
            .collect()
    }

    /// Runs forward: positional inputs, then keyword inputs by name.
    pub fn run(
        &self,
        positional: &[RawTensor],
        keywords: &[(CString, RawTensor)],
        inference_mode: bool,
        threads: usize,
    ) -> Result<Outputs<'_>, String> {
        let names: Vec<*const c_char> = keywords.iter().map(|(n, _)| n.as_ptr()).collect();
        let values: Vec<RawTensor> = keywords.iter().map(|(_, t)| *t).collect();
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: the arrays hold the counts given; every tensor's memory is the caller's, alive
        // during the call, and only read (the shim copies it).
        let result = unsafe {
            (self.shim.run)(
                self.handle,
                positional.as_ptr(),
                positional.len() as i32,
                values.as_ptr(),
                names.as_ptr(),
                values.len() as i32,
                i32::from(inference_mode),
                threads.min(i32::MAX as usize) as i32,
                &mut err,
            )
        };
        if result.is_null() {
            return Err(self.shim.message(err));
        }
        Ok(Outputs { shim: &self.shim, handle: result })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the module is live and no run borrows it any more.
        unsafe { (self.shim.free)(self.handle) };
    }
}

/// What forward returned: outputs by position, with their keys when it returned a dict.
pub struct Outputs<'s> {
    shim: &'s Shim,
    handle: *mut c_void,
}

impl Outputs<'_> {
    pub fn len(&self) -> usize {
        // SAFETY: a live result.
        unsafe { (self.shim.count)(self.handle) }.max(0) as usize
    }

    pub fn keyed(&self) -> bool {
        // SAFETY: a live result.
        unsafe { (self.shim.keyed)(self.handle) != 0 }
    }

    /// Output `index`: its key, and its tensor or strings (borrowed from the result).
    pub fn get(&self, index: usize) -> Option<(String, RawTensor)> {
        let (mut key, mut out): (*const c_char, RawTensor) = (std::ptr::null(), RawTensor::default());
        // SAFETY: fills key and out, valid while the result lives.
        let found = unsafe { (self.shim.output)(self.handle, index as i32, &mut key, &mut out) } == 0;
        // SAFETY: a NUL-terminated key owned by the result.
        (found && !key.is_null()).then(|| (unsafe { CStr::from_ptr(key) }.to_string_lossy().into_owned(), out))
    }
}

impl Drop for Outputs<'_> {
    fn drop(&mut self) {
        // SAFETY: a live result, freed once.
        unsafe { (self.shim.result_free)(self.handle) };
    }
}
