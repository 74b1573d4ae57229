//! ONNX models through ONNX Runtime (`ort`, loaded at run time). The only module that names `ort`.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
};

use bytes::Bytes;
use half::{bf16, f16};
use ort::{
    environment::Environment,
    ep::{ArbitrarilyConfigurableExecutionProvider, CUDA, OpenVINO, TensorRT},
    session::{
        HasSelectedOutputs, OutputSelector, RunOptions, Session, SessionInputValue,
        builder::{GraphOptimizationLevel, SessionBuilder},
    },
    value::{
        DynTensor, DynTensorValueType, DynValue, PrimitiveTensorElementType, Tensor as OrtTensor, TensorElementType,
        TensorRef, ValueType,
    },
};

mod staging;
use staging::Staging;

use super::{
    Backend, BackendInput, Device, DeviceTarget, Executed, InstanceSpec, ModelInstance, ModelIo, TensorInfo,
    accelerators::{self, Plan},
    library,
};
use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    stats::{MemoryUse, resident_bytes},
    tensor::{DataType, Tensor, bytes_elements, push_bytes_element},
};

pub struct OnnxBackend {
    library: Option<PathBuf>,
    /// Where TensorRT engines are cached (per model below it).
    engine_cache: PathBuf,
    environment: OnceLock<Result<Environment, String>>,
    creating: Mutex<()>,
}

impl OnnxBackend {
    /// `library`: the configured ONNX Runtime path; None = discover it.
    pub fn new(library: Option<PathBuf>) -> Self {
        OnnxBackend {
            library,
            engine_cache: std::env::temp_dir().join("ferry-tensorrt"),
            environment: OnceLock::new(),
            creating: Mutex::new(()),
        }
    }

    /// TensorRT engines are built once and kept under `dir` (the model cache).
    pub fn with_engine_cache(mut self, dir: PathBuf) -> Self {
        self.engine_cache = dir;
        self
    }

    /// Loads the library once; every later call returns the same outcome.
    pub fn environment(&self) -> Result<&Environment> {
        self.environment
            .get_or_init(|| {
                let located = library::locate(&library::ONNX_RUNTIME, self.library.as_deref())?;
                tracing::info!(path = %located.path.display(), source = located.source, "loading ONNX Runtime");
                let builder = ort::init_from(&located.path)
                    .map_err(|e| format!("cannot load ONNX Runtime from '{}': {e}", located.path.display()))?;
                builder
                    .with_name("ferry")
                    .build()
                    .map_err(|e| format!("cannot start ONNX Runtime from '{}': {e}", located.path.display()))
            })
            .as_ref()
            .map_err(|e| Error::unavailable(e.clone()))
    }

    /// A session for `path`; `plan` (the config's execution providers) for a served instance.
    fn session(
        &self,
        path: &Path,
        config: Option<&ModelConfig>,
        threads: usize,
        device: Device,
        plan: &Plan,
    ) -> Result<Session> {
        // An optional provider (TensorRT, OpenVINO) that cannot start is said and left out; the
        // session is then built again without it.
        match self.session_with(path, config, threads, device, plan, true) {
            Err(Optional(name, e)) if !name.is_empty() => {
                tracing::warn!(
                    model = config.map_or("", |c| c.name.as_str()),
                    "{name} execution provider is not usable here ({e}); running without it"
                );
                self.session_with(path, config, threads, device, plan, false).map_err(|Optional(_, e)| e)
            }
            other => other.map_err(|Optional(_, e)| e),
        }
    }

    fn session_with(
        &self,
        path: &Path,
        config: Option<&ModelConfig>,
        threads: usize,
        device: Device,
        plan: &Plan,
        optional: bool,
    ) -> std::result::Result<Session, Optional> {
        let required = |e: Error| Optional("", e);
        let env = self.environment().map_err(required)?;
        let ort_err = |e: ort::Error<SessionBuilder>| Error::internal(format!("ONNX Runtime session options: {e}"));
        let mut builder = Session::builder(env).map_err(|e| required(Error::internal(e.to_string())))?;
        if let (Device::Gpu(id), Some(options), true) = (device, &plan.tensorrt, optional) {
            let mut trt = TensorRT::default().with_device_id(id);
            for (k, v) in options {
                trt = trt.with_arbitrary_config(k, v);
            }
            builder = builder
                .with_execution_providers([trt.build().error_on_failure()])
                .map_err(|e| Optional("TensorRT", Error::unavailable(e.to_string())))?;
        }
        if let (Device::Cpu, Some(options), true) = (device, &plan.openvino, optional) {
            let mut ov = OpenVINO::default();
            for (k, v) in options {
                ov = ov.with_arbitrary_config(k, v);
            }
            builder = builder
                .with_execution_providers([ov.build().error_on_failure()])
                .map_err(|e| Optional("OpenVINO", Error::unavailable(e.to_string())))?;
        }
        if let Device::Gpu(id) = device {
            // The CUDA execution provider, or a clear failure: never a silent fall back to CPU.
            let mut cuda = CUDA::default().with_device_id(id);
            for (k, v) in &plan.cuda {
                cuda = cuda.with_arbitrary_config(k, v);
            }
            let cuda = cuda.build().error_on_failure();
            builder = builder.with_execution_providers([cuda]).map_err(|e| {
                let e = e.to_string();
                required(Error::unavailable(format!(
                    "GPU {id}: ONNX Runtime's CUDA execution provider is not usable: {}. A GPU instance needs \
                     onnxruntime-gpu's libonnxruntime_providers_cuda.so beside libonnxruntime, the CUDA runtime \
                     libraries it links (cudart, cublas, cublasLt, curand, cufft, cuDNN) on the library path, and \
                     an NVIDIA driver with that GPU",
                    e.trim_end_matches('.')
                )))
            })?;
        }
        let param = |key: &str| config.and_then(|c| c.parameters.get(key)).map(|p| p.string_value.as_str());
        let threads_of = |key: &str| -> Result<Option<usize>> {
            match param(key).map(str::trim) {
                None | Some("" | "0") => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n <= crate::backend::MAX_THREADS => Ok(Some(n)),
                    _ => Err(Error::invalid(format!(
                        "parameter '{key}' is '{v}'; expected a thread count from 0 (ONNX Runtime's choice) to {}",
                        crate::backend::MAX_THREADS
                    ))),
                },
            }
        };
        let intra = threads_of("intra_op_thread_count").map_err(required)?;
        let ort_err = |e| required(ort_err(e));
        builder = builder.with_intra_threads(intra.unwrap_or(threads)).map_err(ort_err)?;
        let inter = threads_of("inter_op_thread_count").map_err(required)?;
        builder = builder.with_inter_threads(inter.unwrap_or(1)).map_err(ort_err)?;
        // Idle ONNX Runtime threads spin by default, burning the cores the server and other
        // instances need between requests; a server is better off letting them sleep.
        let spinning = param("allow_spinning").is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        builder = builder.with_intra_op_spinning(spinning).map_err(ort_err)?;
        builder = builder.with_inter_op_spinning(spinning).map_err(ort_err)?;
        if param("execution_mode") == Some("1") {
            builder = builder.with_parallel_execution(true).map_err(ort_err)?;
        }
        let level = config.and_then(|c| c.optimization.as_ref()).and_then(|o| o.graph.as_ref()).map_or(0, |g| g.level);
        let level = match level {
            -1 => GraphOptimizationLevel::Level1,
            1 => GraphOptimizationLevel::Level2,
            2 => GraphOptimizationLevel::Disable,
            _ => GraphOptimizationLevel::All,
        };
        builder = builder.with_optimization_level(level).map_err(ort_err)?;
        builder
            .commit_from_file(path)
            .map_err(|e| required(Error::invalid(format!("ONNX Runtime cannot load '{}': {e}", path.display()))))
    }
}

/// A session that failed: the optional provider to blame (empty: none, the error stands).
struct Optional(&'static str, Error);

impl Backend for OnnxBackend {
    fn name(&self) -> &'static str {
        "onnxruntime"
    }

    fn model_io(&self, model_path: &Path) -> Result<ModelIo> {
        Ok(io_of(&self.session(model_path, None, 1, Device::Cpu, &Plan::default())?))
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        // What a session holds (weights, pre-packed kernels, the optimised graph) is measured as
        // the growth of this process's resident memory while it is created, so sessions are
        // created one at a time.
        // The library itself is loaded before, outside the measure.
        self.environment()?;
        let _one = self.creating.lock().unwrap_or_else(|p| p.into_inner());
        release_free_heap();
        let before = resident_bytes("self");
        let plan = accelerators::plan(spec.config, matches!(spec.device, Device::Gpu(_)), &self.engine_cache);
        if spec.index == 0 {
            for warning in &plan.warnings {
                tracing::warn!(model = %spec.config.name, "{warning}");
            }
        }
        let session = self.session(spec.model_path, Some(spec.config), spec.intra_op_threads, spec.device, &plan)?;
        // What creation parsed and dropped (the file's bytes, folded constants) goes back first.
        release_free_heap();
        let grown = before.zip(resident_bytes("self")).map(|(b, a)| a.saturating_sub(b));
        let memory = grown.map(|bytes| MemoryUse { kind: "CPU", id: 0, bytes });
        let staging = match spec.device {
            Device::Gpu(gpu) => match Staging::pinned(&session, gpu) {
                Ok(s) => Some(s),
                Err(e) => {
                    if spec.index == 0 {
                        tracing::warn!(model = %spec.config.name, "no page-locked staging for GPU batches ({e}); ONNX Runtime copies each batch itself");
                    }
                    None
                }
            },
            Device::Cpu => None,
        };
        Ok(Box::new(OnnxInstance {
            session,
            memory,
            selections: HashMap::new(),
            staging,
            on_gpu: matches!(spec.device, Device::Gpu(_)),
        }))
    }
}

/// Returns the C heap's free pages to the system, so that resident memory counts live memory.
fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn datatype(t: TensorElementType) -> Option<DataType> {
    Some(match t {
        TensorElementType::Bool => DataType::Bool,
        TensorElementType::Uint8 => DataType::Uint8,
        TensorElementType::Uint16 => DataType::Uint16,
        TensorElementType::Uint32 => DataType::Uint32,
        TensorElementType::Uint64 => DataType::Uint64,
        TensorElementType::Int8 => DataType::Int8,
        TensorElementType::Int16 => DataType::Int16,
        TensorElementType::Int32 => DataType::Int32,
        TensorElementType::Int64 => DataType::Int64,
        TensorElementType::Float16 => DataType::Fp16,
        TensorElementType::Float32 => DataType::Fp32,
        TensorElementType::Float64 => DataType::Fp64,
        TensorElementType::String => DataType::Bytes,
        TensorElementType::Bfloat16 => DataType::Bf16,
        _ => return None,
    })
}

fn io_of(session: &Session) -> ModelIo {
    let info = |o: &ort::value::Outlet| match o.dtype() {
        ValueType::Tensor { ty, shape, .. } => {
            TensorInfo { name: o.name().to_string(), datatype: datatype(*ty), shape: shape.to_vec() }
        }
        _ => TensorInfo { name: o.name().to_string(), datatype: None, shape: Vec::new() },
    };
    ModelIo {
        inputs: session.inputs().iter().map(info).collect(),
        outputs: session.outputs().iter().map(info).collect(),
    }
}

struct OnnxInstance {
    session: Session,
    /// Measured when the session was created.
    memory: Option<MemoryUse>,
    /// Run options per set of selected outputs, made once.
    selections: HashMap<Vec<String>, RunOptions<HasSelectedOutputs>>,
    /// GPU instances: the I/O-binding batch path (None: ONNX Runtime's own copies).
    staging: Option<Staging>,
    on_gpu: bool,
}

impl ModelInstance for OnnxInstance {
    fn runs_anywhere(&self) -> bool {
        // A GPU session stays on the thread that made its CUDA context current.
        self.staging.is_none() && !self.on_gpu
    }

    fn model_io(&self) -> Option<ModelIo> {
        Some(io_of(&self.session))
    }

    fn memory(&self) -> Vec<MemoryUse> {
        self.memory.iter().cloned().collect()
    }

    fn copy_in_time(&self) -> Option<std::time::Duration> {
        self.staging.as_ref().map(|s| s.copy_in)
    }

    fn device_io(&self) -> Option<i32> {
        self.staging.as_ref().and_then(Staging::gpu)
    }

    fn execute_device(
        &mut self,
        inputs: &[BackendInput<'_>],
        outputs: &[&str],
        targets: &[DeviceTarget<'_>],
    ) -> Result<Executed> {
        if let Some(staging) = &mut self.staging
            && Staging::fits(inputs)
        {
            return staging.run(&mut self.session, inputs, outputs, targets);
        }
        // A batch the staging cannot take (a string input beside one in GPU memory): the plain
        // path, with the GPU's pieces copied to the host.
        let copies = inputs
            .iter()
            .map(|i| i.device.iter().map(|p| p.to_host()).collect::<Result<Vec<_>>>().map(|p| p.concat()))
            .collect::<Result<Vec<Vec<u8>>>>()?;
        let inputs: Vec<BackendInput<'_>> = inputs
            .iter()
            .zip(&copies)
            .map(|(i, copy)| if i.device.is_empty() { *i } else { BackendInput { data: copy, device: &[], ..*i } })
            .collect();
        self.execute(&inputs, outputs).map(Executed::on_host)
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        if let Some(staging) = &mut self.staging
            && Staging::fits(inputs)
        {
            return staging.run(&mut self.session, inputs, outputs, &[]).map(|done| done.outputs);
        }
        let values = inputs
            .iter()
            .map(|i| Ok((i.name, input_value(i)?)))
            .collect::<Result<Vec<(&str, SessionInputValue<'_>)>>>()?;
        let key: Vec<String> = outputs.iter().map(|s| s.to_string()).collect();
        if !self.selections.contains_key(&key) {
            let selector = outputs.iter().fold(OutputSelector::no_default(), |s, name| s.with(*name));
            let options = RunOptions::new().map_err(|e| Error::internal(e.to_string()))?.with_outputs(selector);
            self.selections.insert(key.clone(), options);
        }
        let options = &self.selections[&key];
        let mut results = self
            .session
            .run_with_options(values, options)
            .map_err(|e| Error::internal(format!("ONNX Runtime failed to run the model: {e}")))?;
        take_outputs(&mut results, outputs)
    }
}

/// The named outputs of a run, as tensors, in the order asked.
fn take_outputs(results: &mut ort::session::SessionOutputs<'_>, outputs: &[&str]) -> Result<Vec<Tensor>> {
    outputs
        .iter()
        .map(|name| {
            let value = results
                .remove(*name)
                .ok_or_else(|| Error::internal(format!("ONNX Runtime returned no output '{name}'")))?;
            output_tensor(name, value)
        })
        .collect()
}

fn input_value<'a>(input: &BackendInput<'a>) -> Result<SessionInputValue<'a>> {
    let shape = input.shape.to_vec();
    let data = input.data;
    let value = match input.datatype {
        DataType::Fp32 => typed::<f32>(shape, data),
        DataType::Fp64 => typed::<f64>(shape, data),
        DataType::Fp16 => typed::<f16>(shape, data),
        DataType::Bf16 => typed::<bf16>(shape, data),
        DataType::Int8 => typed::<i8>(shape, data),
        DataType::Int16 => typed::<i16>(shape, data),
        DataType::Int32 => typed::<i32>(shape, data),
        DataType::Int64 => typed::<i64>(shape, data),
        DataType::Uint8 => typed::<u8>(shape, data),
        DataType::Uint16 => typed::<u16>(shape, data),
        DataType::Uint32 => typed::<u32>(shape, data),
        DataType::Uint64 => typed::<u64>(shape, data),
        DataType::Bool => {
            // Validation guarantees every byte is 0 or 1, which are exactly the valid bools.
            let bools = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<bool>(), data.len()) };
            TensorRef::from_array_view((shape, bools)).map(SessionInputValue::from)
        }
        DataType::Bytes => {
            let strings = bytes_elements(data)
                .enumerate()
                .map(|(n, e)| {
                    let e = e?;
                    String::from_utf8(e.to_vec()).map_err(|_| {
                        Error::invalid(format!(
                            "input '{}' element {n} is not valid UTF-8; ONNX string tensors hold UTF-8 text",
                            input.name
                        ))
                    })
                })
                .collect::<Result<Vec<String>>>()?;
            OrtTensor::from_string_array((shape, &strings[..])).map(SessionInputValue::from)
        }
    };
    value.map_err(|e| Error::internal(format!("input '{}': {e}", input.name)))
}

/// A view of the wire bytes when they are aligned for `T`; otherwise one copy.
fn typed<'a, T>(shape: Vec<i64>, data: &'a [u8]) -> ort::Result<SessionInputValue<'a>>
where
    T: PrimitiveTensorElementType + bytemuck::Pod + std::fmt::Debug,
{
    match bytemuck::try_cast_slice::<u8, T>(data) {
        Ok(view) => TensorRef::from_array_view((shape, view)).map(SessionInputValue::from),
        Err(_) => {
            let owned: Vec<T> = bytemuck::pod_collect_to_vec(data);
            OrtTensor::from_array((shape, owned)).map(SessionInputValue::from)
        }
    }
}

/// Keeps an ONNX Runtime output alive while its bytes are used, so the reply needs no copy.
struct OrtBytes {
    tensor: DynTensor,
    len: usize,
}

impl AsRef<[u8]> for OrtBytes {
    fn as_ref(&self) -> &[u8] {
        let ptr = self.tensor.data_ptr().cast::<u8>();
        if self.len == 0 || ptr.is_null() {
            return &[];
        }
        // The tensor owns `len` bytes of CPU memory at `ptr` for as long as it lives.
        unsafe { std::slice::from_raw_parts(ptr, self.len) }
    }
}

fn output_tensor(name: &str, value: DynValue) -> Result<Tensor> {
    let (ty, shape) = match value.dtype() {
        ValueType::Tensor { ty, shape, .. } => (*ty, shape.to_vec()),
        other => {
            return Err(Error::internal(format!("model output '{name}' is {other:?}, not a tensor")));
        }
    };
    let datatype = datatype(ty)
        .ok_or_else(|| Error::internal(format!("model output '{name}' has unsupported element type {ty:?}")))?;
    let data = if datatype == DataType::Bytes {
        let (_, strings) = value.try_extract_strings().map_err(|e| Error::internal(format!("output '{name}': {e}")))?;
        let mut buf = Vec::with_capacity(strings.iter().map(|s| s.len() + 4).sum());
        for s in &strings {
            push_bytes_element(&mut buf, s.as_bytes());
        }
        Bytes::from(buf)
    } else {
        let elements: usize = shape.iter().map(|&d| d.max(0) as usize).product();
        let len = elements * datatype.size().unwrap_or(0);
        let tensor =
            value.downcast::<DynTensorValueType>().map_err(|e| Error::internal(format!("output '{name}': {e}")))?;
        Bytes::from_owner(OrtBytes { tensor, len })
    };
    Ok(Tensor { name: name.to_string(), datatype, shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example `simple` model twice: on the plain path, and on the I/O-binding path with host
    /// memory standing in for GPU `gpu`'s.
    fn simple_instances(gpu: i32) -> (OnnxInstance, OnnxInstance) {
        // ONNX Runtime allows one environment per process: the tests share one backend.
        static BACKEND: OnceLock<OnnxBackend> = OnceLock::new();
        let backend = BACKEND.get_or_init(|| OnnxBackend::new(std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from)));
        if let Err(e) = backend.environment() {
            panic!("ONNX Runtime is needed for this test (scripts/test.sh sets ORT_DYLIB_PATH): {e}");
        }
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/simple/1/model.onnx");
        let session = || backend.session(&path, None, 1, Device::Cpu, &Plan::default()).unwrap();
        let plain =
            OnnxInstance { session: session(), memory: None, selections: HashMap::new(), staging: None, on_gpu: false };
        let staged_session = session();
        let staging = Some(Staging::host(&staged_session, gpu).unwrap());
        (
            plain,
            OnnxInstance { session: staged_session, memory: None, selections: HashMap::new(), staging, on_gpu: true },
        )
    }

    /// The example `simple` model (INT32 add and subtract), through the plain path and through the
    /// I/O-binding path (host staging on the CPU: the GPU path's code with ordinary memory), with
    /// batches of changing shape: the same outputs.
    #[test]
    fn the_staged_path_computes_what_the_plain_path_does() {
        let (mut plain, mut staged) = simple_instances(0);
        for rows in [1usize, 3, 3, 2] {
            let a: Vec<i32> = (0..16 * rows as i32).collect();
            let b: Vec<i32> = (0..16 * rows as i32).map(|v| v * 3 - 7).collect();
            let shape = [rows as i64, 16];
            let inputs = [
                BackendInput {
                    name: "INPUT0",
                    datatype: DataType::Int32,
                    shape: &shape,
                    data: bytemuck::cast_slice(&a),
                    device: &[],
                },
                BackendInput {
                    name: "INPUT1",
                    datatype: DataType::Int32,
                    shape: &shape,
                    data: bytemuck::cast_slice(&b),
                    device: &[],
                },
            ];
            let outputs = ["OUTPUT1", "OUTPUT0"];
            let want = plain.execute(&inputs, &outputs).unwrap();
            let got = staged.execute(&inputs, &outputs).unwrap();
            assert_eq!(got, want, "{rows} rows");
            let sum: &[i32] = bytemuck::cast_slice(&got[1].data);
            assert_eq!(sum[5], a[5] + b[5]);
            assert!(staged.copy_in_time().is_some() && plain.copy_in_time().is_none());
        }
    }

    /// Inputs in GPU memory (host memory standing in for it) are copied device to device into
    /// the batch, and an output every request wants there is written to each request's range:
    /// the same numbers as the plain path, the output coming back written and empty.
    #[test]
    fn device_inputs_and_outputs_skip_the_host() {
        use crate::device::HostMemory;
        let (mut plain, mut staged) = simple_instances(3);
        assert_eq!((plain.device_io(), staged.device_io()), (None, Some(3)));
        let a: Vec<i32> = (0..48).collect();
        let b: Vec<i32> = (0..48).map(|v| v * 5 - 9).collect();
        let shape = [3i64, 16];
        fn host<'a>(name: &'a str, data: &'a [i32]) -> BackendInput<'a> {
            BackendInput {
                name,
                datatype: DataType::Int32,
                shape: &[3, 16],
                data: bytemuck::cast_slice(data),
                device: &[],
            }
        }
        let want = plain.execute(&[host("INPUT0", &a), host("INPUT1", &b)], &["OUTPUT0", "OUTPUT1"]).unwrap();
        // Request one holds row 0 of INPUT0, request two rows 1-2, each in its own region.
        let memory = HostMemory::new(3, vec![0u8; 1024]);
        crate::device::DeviceMemory::write(&*memory, 0, bytemuck::cast_slice(&a)).unwrap();
        let pieces = [memory.range(0, 64), memory.range(64, 128)];
        let device_input =
            BackendInput { name: "INPUT0", datatype: DataType::Int32, shape: &shape, data: &[], device: &pieces };
        // OUTPUT0 goes to GPU memory: request one's row at 256, request two's two rows at 512;
        // a third range, too small, is left alone.
        let (one, two) = (memory.range(256, 64), memory.range(512, 128));
        let targets = [
            DeviceTarget { output: 0, first_row: 0, rows: 1, to: &one },
            DeviceTarget { output: 0, first_row: 1, rows: 2, to: &two },
        ];
        let done =
            staged.execute_device(&[device_input, host("INPUT1", &b)], &["OUTPUT0", "OUTPUT1"], &targets).unwrap();
        assert_eq!(done.written, vec![true, false]);
        assert!(done.outputs[0].data.is_empty());
        assert_eq!(done.outputs[0].shape, vec![3, 16]);
        assert_eq!(done.outputs[1], want[1]);
        let bytes = memory.snapshot();
        assert_eq!(&bytes[256..320], &want[0].data[..64]);
        assert_eq!(&bytes[512..640], &want[0].data[64..]);
        let small = memory.range(900, 100);
        let targets = [
            DeviceTarget { output: 0, first_row: 0, rows: 1, to: &one },
            DeviceTarget { output: 0, first_row: 1, rows: 2, to: &small },
        ];
        let done =
            staged.execute_device(&[device_input, host("INPUT1", &b)], &["OUTPUT0", "OUTPUT1"], &targets).unwrap();
        assert_eq!(done.written, vec![true, false]);
        assert!(memory.snapshot()[900..1000].iter().all(|&v| v == 0), "a target too small is left alone");
        // A device piece from another GPU is refused, not read.
        let elsewhere = HostMemory::new(1, vec![0u8; 192]);
        let foreign = [elsewhere.range(0, 192)];
        let input = BackendInput { device: &foreign, ..device_input };
        let e = staged.execute_device(&[input, host("INPUT1", &b)], &["OUTPUT0"], &[]).unwrap_err();
        assert!(e.message().contains("is on GPU 1, this instance on GPU 3"), "{e}");
    }
}
