//! An AOTInductor model library's C ABI, loaded at run time: its container
//! (`AOTInductorModelContainer*`, torch/csrc/inductor/aoti_runtime/interface.h), over tensors of
//! PyTorch's stable C ABI (`super::super::ctensor`). Every C++ exception stays on PyTorch's side:
//! each entry point returns an error code.
use std::{
    ffi::{CString, c_char, c_void},
    path::Path,
};

use super::super::ctensor::{Tensor, TensorHandle, Torch};
use crate::backend::library::{self, symbol};

type ContainerHandle = *mut c_void;

/// A model library's entry points (the container API every AOTInductor package has).
pub struct ModelLibrary {
    create: unsafe extern "C" fn(*mut ContainerHandle, usize, *const c_char, *const c_char) -> i32,
    delete: unsafe extern "C" fn(ContainerHandle) -> i32,
    run: unsafe extern "C" fn(
        ContainerHandle,
        *mut TensorHandle,
        usize,
        *mut TensorHandle,
        usize,
        *mut c_void,
        *mut c_void,
    ) -> i32,
    inputs: unsafe extern "C" fn(ContainerHandle, *mut usize) -> i32,
    outputs: unsafe extern "C" fn(ContainerHandle, *mut usize) -> i32,
    call_spec: unsafe extern "C" fn(ContainerHandle, *mut *const c_char, *mut *const c_char) -> i32,
    /// Newer packages keep the last error's words for the caller; older ones print them.
    last_error: Option<unsafe extern "C" fn(*mut *const c_char) -> i32>,
    _library: libloading::Library,
}

// SAFETY: the container API is thread-safe (its runs take a model from a locked pool).
unsafe impl Send for ModelLibrary {}
unsafe impl Sync for ModelLibrary {}

impl ModelLibrary {
    /// Loads a package's model library; PyTorch's own libraries must be loaded already (the
    /// library needs them by name).
    pub fn load(path: &Path) -> Result<ModelLibrary, String> {
        // SAFETY: a model library's initializers only set up its own statics.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load the package's model library: {e}"))?;
        // SAFETY: GetLastError(const char**) as interface.h declares it.
        let last_error =
            unsafe { lib.get::<unsafe extern "C" fn(*mut *const c_char) -> i32>(b"AOTInductorGetLastError\0") }
                .ok()
                .map(|s| *s);
        Ok(ModelLibrary {
            create: symbol!(lib, "AOTInductor model", "AOTInductorModelContainerCreateWithDevice"),
            delete: symbol!(lib, "AOTInductor model", "AOTInductorModelContainerDelete"),
            run: symbol!(lib, "AOTInductor model", "AOTInductorModelContainerRun"),
            inputs: symbol!(lib, "AOTInductor model", "AOTInductorModelContainerGetNumInputs"),
            outputs: symbol!(lib, "AOTInductor model", "AOTInductorModelContainerGetNumOutputs"),
            call_spec: symbol!(lib, "AOTInductor model", "AOTInductorModelContainerGetCallSpec"),
            last_error,
            _library: lib,
        })
    }

    fn error(&self, what: &str) -> String {
        let Some(f) = self.last_error else {
            return format!("{what} failed (PyTorch wrote why to the server's standard error)");
        };
        let mut msg: *const c_char = std::ptr::null();
        // SAFETY: the message is valid until this thread's next call into the library.
        let text = unsafe {
            f(&mut msg);
            library::text(msg)
        };
        if text.is_empty() { format!("{what} failed") } else { format!("{what} failed: {}", clip(&text)) }
    }
}

/// PyTorch's messages can quote generated source at length.
fn clip(text: &str) -> &str {
    let end = text.char_indices().nth(2000).map_or(text.len(), |(i, _)| i);
    text[..end].trim_end()
}

/// A container of `models` copies of the compiled model sharing one set of weights; its runs
/// may come from any thread (each takes a free copy).
pub struct Container {
    library: std::sync::Arc<ModelLibrary>,
    handle: ContainerHandle,
    pub inputs: usize,
    pub outputs: usize,
    /// The package's call spec (pytree specs of the inputs and of the outputs), as JSON text.
    pub in_spec: String,
    pub out_spec: String,
}

// SAFETY: see ModelLibrary.
unsafe impl Send for Container {}
unsafe impl Sync for Container {}

impl Container {
    pub fn new(model: std::sync::Arc<ModelLibrary>, models: usize, cubin_dir: &Path) -> Result<Container, String> {
        let device = CString::new("cpu").unwrap_or_default();
        let dir = CString::new(cubin_dir.as_os_str().as_encoded_bytes())
            .map_err(|_| "a path holds a NUL byte".to_string())?;
        let mut handle: ContainerHandle = std::ptr::null_mut();
        // SAFETY: CreateWithDevice(handle*, num_models, device, cubin_dir) as interface.h declares it.
        let err = unsafe { (model.create)(&mut handle, models.max(1), device.as_ptr(), dir.as_ptr()) };
        if err != 0 || handle.is_null() {
            return Err(model.error("creating the model (loading its weights)"));
        }
        let mut c = Container {
            library: model,
            handle,
            inputs: 0,
            outputs: 0,
            in_spec: String::new(),
            out_spec: String::new(),
        };
        let (mut i, mut o) = (0usize, 0usize);
        let (mut ins, mut outs): (*const c_char, *const c_char) = (std::ptr::null(), std::ptr::null());
        // SAFETY: the getters write through their pointers; the spec strings live with the container.
        let err = unsafe {
            (c.library.inputs)(c.handle, &mut i)
                | (c.library.outputs)(c.handle, &mut o)
                | (c.library.call_spec)(c.handle, &mut ins, &mut outs)
        };
        if err != 0 {
            return Err(c.library.error("reading the model's inputs and outputs"));
        }
        c.inputs = i;
        c.outputs = o;
        // SAFETY: NUL-terminated strings owned by the container.
        (c.in_spec, c.out_spec) = unsafe { (library::text(ins), library::text(outs)) };
        Ok(c)
    }

    /// Runs the model on `inputs` (which it takes); the outputs are PyTorch's handles.
    pub fn run<'t>(&self, torch: &'t Torch, inputs: Vec<Tensor<'t>>) -> Result<Vec<Tensor<'t>>, String> {
        if inputs.len() != self.inputs {
            return Err(format!("the model takes {} inputs, {} were given", self.inputs, inputs.len()));
        }
        let mut ins: Vec<TensorHandle> = inputs.into_iter().map(Tensor::release).collect();
        let mut outs: Vec<TensorHandle> = vec![std::ptr::null_mut(); self.outputs];
        // SAFETY: the input handles are stolen by the call; the output array has room for every
        // output, whose handles the caller then owns.
        let err = unsafe {
            (self.library.run)(
                self.handle,
                ins.as_mut_ptr(),
                ins.len(),
                outs.as_mut_ptr(),
                outs.len(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        // SAFETY: whatever the run set is a live tensor the caller owns now.
        let owned: Vec<Tensor<'t>> = outs.iter().filter(|h| !h.is_null()).map(|&h| unsafe { torch.own(h) }).collect();
        if err != 0 {
            return Err(self.library.error("the model's run"));
        }
        if owned.len() != self.outputs {
            return Err("the model's run gave fewer outputs than it declares".into());
        }
        Ok(owned)
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        // SAFETY: the handle is live and nothing runs on it any more (runs borrow the container).
        unsafe { (self.library.delete)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_clipped() {
        assert_eq!(clip(&"x".repeat(5000)).len(), 2000);
        assert_eq!(clip("short "), "short");
    }
}
