//! OpenVINO's C API (`libopenvino_c.so`, loaded at run time): a core, models read from files,
//! reshaped and compiled, and one synchronous infer request per instance over host memory.
use std::{
    ffi::{CStr, CString, c_char, c_int, c_void},
    path::Path,
    sync::{Arc, Mutex},
};

use crate::{
    backend::library::{self, symbol},
    tensor::DataType,
};

type Handle = *mut c_void;

/// Largest output one run may give (OpenVINO allocates it; ferry copies it into the answer).
pub const MAX_OUTPUT_BYTES: usize = 1 << 31;

/// `ov_dimension_t` (also `ov_rank_t`): an interval; -1 as both ends is a dynamic dimension.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dimension {
    pub min: i64,
    pub max: i64,
}

impl Dimension {
    pub const DYNAMIC: Dimension = Dimension { min: -1, max: -1 };

    pub fn fixed(n: i64) -> Dimension {
        Dimension { min: n, max: n }
    }

    /// As the protocol writes a dimension: its size, or -1 when it varies.
    pub fn size(self) -> i64 {
        if self.min == self.max && self.min >= 0 { self.min } else { -1 }
    }
}

#[repr(C)]
struct PartialShape {
    rank: Dimension,
    dims: *mut Dimension,
}

#[repr(C)]
struct Shape {
    rank: i64,
    dims: *mut i64,
}

/// The entry points ferry calls, resolved once from the library.
pub struct Api {
    get_version: unsafe extern "C" fn(*mut [*const c_char; 2]) -> c_int,
    version_free: unsafe extern "C" fn(*mut [*const c_char; 2]),
    last_error: unsafe extern "C" fn() -> *const c_char,
    error_info: unsafe extern "C" fn(c_int) -> *const c_char,
    free_string: unsafe extern "C" fn(*const c_char),
    core_create: unsafe extern "C" fn(*mut Handle) -> c_int,
    core_free: unsafe extern "C" fn(Handle),
    read_model: unsafe extern "C" fn(Handle, *const c_char, *const c_char, *mut Handle) -> c_int,
    model_free: unsafe extern "C" fn(Handle),
    model_inputs: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    model_outputs: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    model_input: unsafe extern "C" fn(Handle, usize, *mut Handle) -> c_int,
    model_output: unsafe extern "C" fn(Handle, usize, *mut Handle) -> c_int,
    reshape: unsafe extern "C" fn(Handle, *const usize, *const PartialShape, usize) -> c_int,
    port_name: unsafe extern "C" fn(Handle, *mut *mut c_char) -> c_int,
    port_type: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    port_shape: unsafe extern "C" fn(Handle, *mut PartialShape) -> c_int,
    port_free: unsafe extern "C" fn(Handle),
    partial_shape_free: unsafe extern "C" fn(*mut PartialShape),
    compile: unsafe extern "C" fn(Handle, Handle, *const c_char, usize, *mut Handle, ...) -> c_int,
    compiled_free: unsafe extern "C" fn(Handle),
    create_request: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    request_free: unsafe extern "C" fn(Handle),
    set_input: unsafe extern "C" fn(Handle, usize, Handle) -> c_int,
    get_output: unsafe extern "C" fn(Handle, usize, *mut Handle) -> c_int,
    infer: unsafe extern "C" fn(Handle) -> c_int,
    tensor_create: unsafe extern "C" fn(c_int, Shape, *mut Handle) -> c_int,
    tensor_from_host: unsafe extern "C" fn(c_int, Shape, *mut c_void, *mut Handle) -> c_int,
    tensor_shape: unsafe extern "C" fn(Handle, *mut Shape) -> c_int,
    tensor_type: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    tensor_bytes: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    tensor_size: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    tensor_data: unsafe extern "C" fn(Handle, *mut *mut c_void) -> c_int,
    tensor_free: unsafe extern "C" fn(Handle),
    shape_free: unsafe extern "C" fn(*mut Shape),
    /// The numbering of `ov_element_type_e` this library uses (it moved by one in 2026).
    types: ElementTypes,
    /// OpenVINO keeps one last error for the whole process: a load-time call and the read of its
    /// message hold this, so two loads failing at once keep their own messages. Inference never
    /// takes it (nor reads the message).
    errors: Mutex<()>,
    pub version: String,
    /// Last: the entry points above live as long as it.
    _library: libloading::Library,
}

// SAFETY: the entry points are plain C functions; OpenVINO's objects are used by one thread at
// a time (`&mut`) except the core and compiled models, which OpenVINO documents as thread-safe.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

/// `ov_element_type_e`: OpenVINO 2025 counts from UNDEFINED = 0, DYNAMIC = 1, BOOLEAN = 2, ...;
/// 2026 dropped UNDEFINED, so every value is one less. Told apart by the size of an F32.
#[derive(Debug, Clone, Copy)]
struct ElementTypes {
    offset: c_int,
}

/// The protocol's types in the 2026 numbering.
const TYPES: &[(DataType, c_int)] = &[
    (DataType::Bool, 1),
    (DataType::Bf16, 2),
    (DataType::Fp16, 3),
    (DataType::Fp32, 4),
    (DataType::Fp64, 5),
    (DataType::Int8, 7),
    (DataType::Int16, 8),
    (DataType::Int32, 9),
    (DataType::Int64, 10),
    (DataType::Uint8, 16),
    (DataType::Uint16, 17),
    (DataType::Uint32, 18),
    (DataType::Uint64, 19),
];

impl ElementTypes {
    fn of(self, t: DataType) -> Option<c_int> {
        TYPES.iter().find(|(d, _)| *d == t).map(|(_, v)| v + self.offset)
    }

    fn datatype(self, v: c_int) -> Option<DataType> {
        TYPES.iter().find(|(_, n)| n + self.offset == v).map(|(d, _)| *d)
    }
}

impl Api {
    pub fn load(path: &Path) -> Result<Api, String> {
        // SAFETY: loading runs the library's initialisers (OpenVINO's C++ statics).
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load OpenVINO from '{}': {e}", path.display()))?;
        let mut api = Api {
            get_version: symbol!(lib, "OpenVINO", "ov_get_openvino_version"),
            version_free: symbol!(lib, "OpenVINO", "ov_version_free"),
            last_error: symbol!(lib, "OpenVINO", "ov_get_last_err_msg"),
            error_info: symbol!(lib, "OpenVINO", "ov_get_error_info"),
            free_string: symbol!(lib, "OpenVINO", "ov_free"),
            core_create: symbol!(lib, "OpenVINO", "ov_core_create"),
            core_free: symbol!(lib, "OpenVINO", "ov_core_free"),
            read_model: symbol!(lib, "OpenVINO", "ov_core_read_model"),
            model_free: symbol!(lib, "OpenVINO", "ov_model_free"),
            model_inputs: symbol!(lib, "OpenVINO", "ov_model_inputs_size"),
            model_outputs: symbol!(lib, "OpenVINO", "ov_model_outputs_size"),
            model_input: symbol!(lib, "OpenVINO", "ov_model_const_input_by_index"),
            model_output: symbol!(lib, "OpenVINO", "ov_model_const_output_by_index"),
            reshape: symbol!(lib, "OpenVINO", "ov_model_reshape_by_port_indexes"),
            port_name: symbol!(lib, "OpenVINO", "ov_port_get_any_name"),
            port_type: symbol!(lib, "OpenVINO", "ov_port_get_element_type"),
            port_shape: symbol!(lib, "OpenVINO", "ov_port_get_partial_shape"),
            port_free: symbol!(lib, "OpenVINO", "ov_output_const_port_free"),
            partial_shape_free: symbol!(lib, "OpenVINO", "ov_partial_shape_free"),
            compile: symbol!(lib, "OpenVINO", "ov_core_compile_model"),
            compiled_free: symbol!(lib, "OpenVINO", "ov_compiled_model_free"),
            create_request: symbol!(lib, "OpenVINO", "ov_compiled_model_create_infer_request"),
            request_free: symbol!(lib, "OpenVINO", "ov_infer_request_free"),
            set_input: symbol!(lib, "OpenVINO", "ov_infer_request_set_input_tensor_by_index"),
            get_output: symbol!(lib, "OpenVINO", "ov_infer_request_get_output_tensor_by_index"),
            infer: symbol!(lib, "OpenVINO", "ov_infer_request_infer"),
            tensor_create: symbol!(lib, "OpenVINO", "ov_tensor_create"),
            tensor_from_host: symbol!(lib, "OpenVINO", "ov_tensor_create_from_host_ptr"),
            tensor_shape: symbol!(lib, "OpenVINO", "ov_tensor_get_shape"),
            tensor_type: symbol!(lib, "OpenVINO", "ov_tensor_get_element_type"),
            tensor_bytes: symbol!(lib, "OpenVINO", "ov_tensor_get_byte_size"),
            tensor_size: symbol!(lib, "OpenVINO", "ov_tensor_get_size"),
            tensor_data: symbol!(lib, "OpenVINO", "ov_tensor_data"),
            tensor_free: symbol!(lib, "OpenVINO", "ov_tensor_free"),
            shape_free: symbol!(lib, "OpenVINO", "ov_shape_free"),
            types: ElementTypes { offset: 0 },
            errors: Mutex::new(()),
            version: String::new(),
            _library: lib,
        };
        let mut version = [std::ptr::null::<c_char>(); 2];
        // SAFETY: OpenVINO fills the two strings and frees them in ov_version_free.
        unsafe {
            api.check((api.get_version)(&mut version), "reading its version")?;
            api.version = CStr::from_ptr(version[0]).to_string_lossy().into_owned();
            (api.version_free)(&mut version);
        }
        let major: u32 = api.version.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0);
        if major < 2025 {
            return Err(format!("OpenVINO {} is too old; ferry takes OpenVINO 2025.0 or newer", api.version));
        }
        api.types = api.element_numbering()?;
        Ok(api)
    }

    /// Which numbering of element types the library uses: an F32 of one element is 4 bytes.
    fn element_numbering(&self) -> Result<ElementTypes, String> {
        let mut one = [1i64];
        let mut tensor: Handle = std::ptr::null_mut();
        let mut bytes = 0usize;
        // SAFETY: a one-element tensor OpenVINO allocates and that is freed here.
        unsafe {
            self.check(
                (self.tensor_create)(4, Shape { rank: 1, dims: one.as_mut_ptr() }, &mut tensor),
                "probing types",
            )?;
            let rc = (self.tensor_bytes)(tensor, &mut bytes);
            (self.tensor_free)(tensor);
            self.check(rc, "probing types")?;
        }
        match bytes {
            4 => Ok(ElementTypes { offset: 0 }),
            2 => Ok(ElementTypes { offset: 1 }),
            n => Err(format!("OpenVINO {}: element type 4 has {n} bytes, which neither numbering gives", self.version)),
        }
    }

    /// `Ok` when `rc` is 0, else an error naming the call and OpenVINO's status (never OpenVINO's
    /// last message: it is one for the whole process, and may be another request's, holding
    /// that client's values).
    fn check(&self, rc: c_int, what: &str) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        Err(format!("OpenVINO {what} failed ({})", self.status(rc)))
    }

    /// OpenVINO's name of a status (a static string).
    fn status(&self, rc: c_int) -> String {
        // SAFETY: ov_get_error_info returns a static NUL-terminated string (or null).
        let p = unsafe { (self.error_info)(rc) };
        let name =
            if p.is_null() { String::new() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
        format!("status {rc}{}", if name.is_empty() { String::new() } else { format!(", {}", name.to_lowercase()) })
    }

    /// OpenVINO's last message (empty when none).
    fn last_message(&self) -> String {
        // SAFETY: ov_get_last_err_msg returns a copy (or null) that ov_free releases.
        unsafe {
            let p = (self.last_error)();
            if p.is_null() {
                return String::new();
            }
            let s = library::text(p);
            (self.free_string)(p);
            s
        }
    }

    /// Runs a load-time call (reading, reshaping, compiling a model), one at a time, and on
    /// failure gives OpenVINO's message, when the call left a new one (a call that fails on a
    /// bad parameter leaves none, and the last is then another call's).
    fn guarded(&self, what: &str, call: impl FnOnce() -> c_int) -> Result<(), String> {
        let _one = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        let before = self.last_message();
        let rc = call();
        if rc == 0 {
            return Ok(());
        }
        let msg = self.last_message();
        if msg.is_empty() || msg == before {
            return self.check(rc, what);
        }
        Err(format!("OpenVINO {what} failed ({}): {}", self.status(rc), tidy(&msg)))
    }
}

/// OpenVINO's message without the source locations it prefixes.
fn tidy(msg: &str) -> String {
    let lines: Vec<&str> = msg
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Exception from src/") && !l.starts_with("Check '"))
        .collect();
    if lines.is_empty() { msg.trim().to_string() } else { lines.join(" ") }
}

/// An input or output of a model: its name, element type (None: one the protocol lacks) and
/// dimensions.
#[derive(Debug, Clone)]
pub struct Port {
    pub name: String,
    pub datatype: Option<DataType>,
    pub element: c_int,
    pub dims: Vec<Dimension>,
    /// False for a dynamic rank (`dims` then empty): served only once reshaped.
    pub ranked: bool,
}

pub struct Core {
    api: Arc<Api>,
    handle: Handle,
}

// SAFETY: ov::Core is thread-safe (reads and compiles from several threads).
unsafe impl Send for Core {}
unsafe impl Sync for Core {}

impl Drop for Core {
    fn drop(&mut self) {
        // SAFETY: made by ov_core_create, freed once, after every model compiled by it (they
        // hold an Arc of the core).
        unsafe { (self.api.core_free)(self.handle) };
    }
}

impl Core {
    pub fn new(api: Arc<Api>) -> Result<Core, String> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` receives the core.
        api.guarded("creating a core", || unsafe { (api.core_create)(&mut handle) })?;
        Ok(Core { api, handle })
    }

    /// Reads a model (IR `.xml` with its `.bin` beside, ONNX, a TensorFlow SavedModel folder,
    /// ...; the format is told from the path).
    pub fn read(self: &Arc<Core>, path: &Path) -> Result<Model, String> {
        let file = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("'{}' has a NUL in its path", path.display()))?;
        let mut handle: Handle = std::ptr::null_mut();
        let what = format!("reading '{}'", path.display());
        // SAFETY: `file` outlives the call; no separate weights path (IR finds its .bin).
        self.api.guarded(&what, || unsafe {
            (self.api.read_model)(self.handle, file.as_ptr(), std::ptr::null(), &mut handle)
        })?;
        Ok(Model { core: Arc::clone(self), handle })
    }
}

pub struct Model {
    core: Arc<Core>,
    handle: Handle,
}

// SAFETY: a model is read, reshaped and compiled by one thread at a time.
unsafe impl Send for Model {}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: made by ov_core_read_model, freed once.
        unsafe { (self.core.api.model_free)(self.handle) };
    }
}

impl Model {
    fn ports(&self, outputs: bool) -> Result<Vec<Port>, String> {
        let api = &self.core.api;
        let mut n = 0usize;
        // SAFETY: `n` receives the count.
        let rc = unsafe {
            if outputs { (api.model_outputs)(self.handle, &mut n) } else { (api.model_inputs)(self.handle, &mut n) }
        };
        api.check(rc, "counting the model's tensors")?;
        (0..n)
            .map(|i| {
                let mut port: Handle = std::ptr::null_mut();
                // SAFETY: `i` is below the count; the port is freed by `read_port`.
                let rc = unsafe {
                    if outputs {
                        (api.model_output)(self.handle, i, &mut port)
                    } else {
                        (api.model_input)(self.handle, i, &mut port)
                    }
                };
                api.check(rc, "reading a model tensor")?;
                read_port(api, port, i)
            })
            .collect()
    }

    pub fn inputs(&self) -> Result<Vec<Port>, String> {
        self.ports(false)
    }

    pub fn outputs(&self) -> Result<Vec<Port>, String> {
        self.ports(true)
    }

    /// Gives the inputs at these indexes new shapes (the others keep theirs).
    pub fn reshape(&mut self, shapes: &[(usize, Vec<Dimension>)]) -> Result<(), String> {
        if shapes.is_empty() {
            return Ok(());
        }
        let indexes: Vec<usize> = shapes.iter().map(|(i, _)| *i).collect();
        let mut dims: Vec<Vec<Dimension>> = shapes.iter().map(|(_, d)| d.clone()).collect();
        let partial: Vec<PartialShape> = dims
            .iter_mut()
            .map(|d| PartialShape { rank: Dimension::fixed(d.len() as i64), dims: d.as_mut_ptr() })
            .collect();
        let api = &self.core.api;
        // SAFETY: the indexes and shapes outlive the call, which copies them.
        api.guarded("reshaping the model", || unsafe {
            (api.reshape)(self.handle, indexes.as_ptr(), partial.as_ptr(), shapes.len())
        })
    }

    /// Compiles the model for `device` with the given properties (at most six).
    pub fn compile(&self, device: &str, properties: &[(String, String)]) -> Result<Compiled, String> {
        if properties.len() > 6 {
            return Err("more than six OpenVINO properties".into());
        }
        let device = CString::new(device).map_err(|_| "TARGET_DEVICE has a NUL".to_string())?;
        let owned: Vec<CString> = properties
            .iter()
            .flat_map(|(k, v)| [k, v])
            .map(|s| CString::new(s.as_str()).map_err(|_| format!("property '{s}' has a NUL")))
            .collect::<Result<_, _>>()?;
        let mut args = [std::ptr::null::<c_char>(); 12];
        for (slot, s) in args.iter_mut().zip(&owned) {
            *slot = s.as_ptr();
        }
        let api = &self.core.api;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: OpenVINO reads `owned.len()` of the strings passed (key, value, ...); the rest
        // are null and not read. Every string outlives the call.
        api.guarded(&format!("compiling the model for {}", device.to_string_lossy()), || unsafe {
            (api.compile)(
                self.core.handle,
                self.handle,
                device.as_ptr(),
                owned.len(),
                &mut handle,
                args[0],
                args[1],
                args[2],
                args[3],
                args[4],
                args[5],
                args[6],
                args[7],
                args[8],
                args[9],
                args[10],
                args[11],
            )
        })?;
        Ok(Compiled { core: Arc::clone(&self.core), handle })
    }
}

fn read_port(api: &Api, port: Handle, index: usize) -> Result<Port, String> {
    let mut name: *mut c_char = std::ptr::null_mut();
    let mut element: c_int = 0;
    let mut shape = PartialShape { rank: Dimension::fixed(0), dims: std::ptr::null_mut() };
    // SAFETY: the port came from OpenVINO; each output is freed by its own call below.
    let read = unsafe {
        if (api.port_name)(port, &mut name) != 0 {
            name = std::ptr::null_mut();
        }
        let typed = api.check((api.port_type)(port, &mut element), "reading a tensor's type");
        let shaped = api.check((api.port_shape)(port, &mut shape), "reading a tensor's shape");
        (api.port_free)(port);
        typed.and(shaped)
    };
    // A tensor with no name is known by its position, as OpenVINO's own tools write it.
    let text = if name.is_null() {
        format!("{index}")
    } else {
        // SAFETY: a NUL-terminated copy, released with ov_free.
        unsafe {
            let s = CStr::from_ptr(name).to_string_lossy().into_owned();
            (api.free_string)(name);
            s
        }
    };
    read?;
    let dims = if shape.rank.min == shape.rank.max && shape.rank.min >= 0 && !shape.dims.is_null() {
        // SAFETY: a static rank has that many dimensions.
        unsafe { std::slice::from_raw_parts(shape.dims, shape.rank.min as usize) }.to_vec()
    } else {
        Vec::new()
    };
    let ranked = shape.rank.min == shape.rank.max && shape.rank.min >= 0;
    // SAFETY: the shape was filled by ov_port_get_partial_shape.
    unsafe { (api.partial_shape_free)(&mut shape) };
    Ok(Port { name: text, datatype: api.types.datatype(element), element, dims, ranked })
}

pub struct Compiled {
    core: Arc<Core>,
    handle: Handle,
}

// SAFETY: ov::CompiledModel is thread-safe.
unsafe impl Send for Compiled {}

impl Drop for Compiled {
    fn drop(&mut self) {
        // SAFETY: made by ov_core_compile_model, freed once, after its request (which holds it).
        unsafe { (self.core.api.compiled_free)(self.handle) };
    }
}

impl Compiled {
    pub fn request(self) -> Result<Request, String> {
        let api = &self.core.api;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: `handle` receives the request.
        api.guarded("creating an infer request", || unsafe { (api.create_request)(self.handle, &mut handle) })?;
        Ok(Request { compiled: self, handle })
    }
}

/// An output of a run, copied out of OpenVINO's memory.
pub struct Output {
    pub datatype: Option<DataType>,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

pub struct Request {
    /// Field order: the request is freed (Drop) before the compiled model.
    compiled: Compiled,
    handle: Handle,
}

// SAFETY: an infer request is used by one thread at a time (`&mut self`).
unsafe impl Send for Request {}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: made by ov_compiled_model_create_infer_request, freed once.
        unsafe { (self.compiled.core.api.request_free)(self.handle) };
    }
}

impl Request {
    fn api(&self) -> &Api {
        &self.compiled.core.api
    }

    /// Sets input `index` to `data` (row-major, of `datatype`), read in place during `infer`.
    /// The caller keeps `data` alive and unchanged until `infer` returns.
    pub fn set_input(&mut self, index: usize, datatype: DataType, shape: &[i64], data: &[u8]) -> Result<(), String> {
        let api = self.api();
        let element = api.types.of(datatype).ok_or_else(|| format!("OpenVINO has no {} type", datatype.wire()))?;
        let mut dims = shape.to_vec();
        let mut tensor: Handle = std::ptr::null_mut();
        // SAFETY: OpenVINO wraps the caller's bytes without copying; it only reads an input.
        // The wrapper is released at once (the request keeps its own reference).
        unsafe {
            let made = (api.tensor_from_host)(
                element,
                Shape { rank: dims.len() as i64, dims: dims.as_mut_ptr() },
                data.as_ptr().cast_mut().cast(),
                &mut tensor,
            );
            api.check(made, "wrapping an input")?;
            let rc = (api.set_input)(self.handle, index, tensor);
            (api.tensor_free)(tensor);
            api.check(rc, "setting an input")
        }
    }

    pub fn infer(&mut self) -> Result<(), String> {
        let api = self.api();
        // SAFETY: the inputs were set and are alive (the caller's contract).
        api.check(unsafe { (api.infer)(self.handle) }, "running the model")
    }

    /// Output `index` of the last run, copied out.
    pub fn output(&mut self, index: usize) -> Result<Output, String> {
        let api = self.api();
        let mut tensor: Handle = std::ptr::null_mut();
        // SAFETY: the request owns the output's memory; the wrapper is freed on every path.
        unsafe {
            api.check((api.get_output)(self.handle, index, &mut tensor), "reading an output")?;
            let out = read_tensor(api, tensor);
            (api.tensor_free)(tensor);
            out
        }
    }
}

/// # Safety
/// `tensor` is a live tensor of OpenVINO's.
unsafe fn read_tensor(api: &Api, tensor: Handle) -> Result<Output, String> {
    let mut shape = Shape { rank: 0, dims: std::ptr::null_mut() };
    let (mut element, mut bytes, mut data) = (0 as c_int, 0usize, std::ptr::null_mut::<c_void>());
    unsafe {
        api.check((api.tensor_type)(tensor, &mut element), "reading an output's type")?;
        api.check((api.tensor_bytes)(tensor, &mut bytes), "reading an output's size")?;
        if bytes > MAX_OUTPUT_BYTES {
            return Err(format!("an output of {bytes} bytes is more than ferry answers ({MAX_OUTPUT_BYTES})"));
        }
        // OpenVINO's C API gives no shape for a scalar (rank 0): one element and no shape is one.
        let dims = if (api.tensor_shape)(tensor, &mut shape) != 0 {
            let mut size = 0usize;
            api.check((api.tensor_size)(tensor, &mut size), "reading an output's shape")?;
            if size != 1 {
                return Err("OpenVINO gave an output without its shape".into());
            }
            Vec::new()
        } else {
            let dims = if shape.dims.is_null() || shape.rank <= 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(shape.dims, shape.rank as usize).to_vec()
            };
            (api.shape_free)(&mut shape);
            dims
        };
        let data_bytes = if bytes == 0 {
            Vec::new()
        } else {
            api.check((api.tensor_data)(tensor, &mut data), "reading an output")?;
            std::slice::from_raw_parts(data.cast::<u8>(), bytes).to_vec()
        };
        Ok(Output { datatype: api.types.datatype(element), shape: dims, data: data_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_numberings_map_the_protocols_types() {
        let new = ElementTypes { offset: 0 };
        let old = ElementTypes { offset: 1 };
        assert_eq!(new.of(DataType::Fp32), Some(4));
        assert_eq!(old.of(DataType::Fp32), Some(5));
        assert_eq!(new.datatype(10), Some(DataType::Int64));
        assert_eq!(old.datatype(11), Some(DataType::Int64));
        assert_eq!(new.datatype(23), None); // STRING
        assert_eq!(new.of(DataType::Bytes), None);
    }

    #[test]
    fn messages_lose_their_source_locations() {
        let raw = "Exception from src/inference/src/cpp/core.cpp:84:\nCheck 'exists' failed at src/frontend.cpp:117:\n\
                   FrontEnd API failed with GeneralFailure:\nonnx: Could not open the file: \"/x.onnx\"\n\n";
        assert_eq!(tidy(raw), "FrontEnd API failed with GeneralFailure: onnx: Could not open the file: \"/x.onnx\"");
    }

    #[test]
    fn a_dimension_is_a_size_or_minus_one() {
        assert_eq!(Dimension::fixed(3).size(), 3);
        assert_eq!(Dimension::DYNAMIC.size(), -1);
        assert_eq!(Dimension { min: 0, max: -1 }.size(), -1);
        assert_eq!(Dimension { min: 1, max: 8 }.size(), -1);
    }
}
