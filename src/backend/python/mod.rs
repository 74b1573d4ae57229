//! The Python backend: Triton's Python models (`<version>/model.py` defining `TritonPythonModel`)
//! run unchanged, each instance in its own Python process started by ferry (`stub.py`, with the
//! `triton_python_backend_utils` module of `pb_utils.py`), so a crash, a leak or the GIL of one
//! model never touches the server or another instance. ferry does not link libpython: any
//! Python >= 3.9 with numpy will do. Which Python: the model's `EXECUTION_ENV_PATH` parameter (a
//! folder holding `bin/python3`, or a conda-pack archive unpacked once into the model cache),
//! else `--backend-config python,executable=<path>`, else `python3` on PATH.
use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock, atomic::AtomicU64},
    time::Duration,
};

use serde_json::{Value, json};

use crate::{
    backend::{Backend, Device, HostSlot, InstanceSpec, ModelInstance, ModelIo},
    error::{Error, Result},
    proto::inference::ModelConfig,
    proto::pbtxt,
};

mod bls;
mod env;
mod instance;
mod link;
pub mod live;
mod process;

/// The message protocol with Python processes, for the fuzz tests: framing, and tensors.
pub use link::tensors;
use process::Process;
pub use process::read_message;

const STUB: &str = include_str!("stub.py");
const PB_UTILS: &str = include_str!("pb_utils.py");

/// `--backend-config python,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonSettings {
    /// `executable=<path>`: the Python to run models with (default `python3` on PATH).
    pub executable: Option<PathBuf>,
    /// `stub-timeout-seconds=<n>` (Triton's key): how long start-up and `initialize` may take.
    pub stub_timeout: Duration,
    /// Where EXECUTION_ENV_PATH archives are unpacked (the model cache).
    pub envs_dir: PathBuf,
    /// `execute-timeout-seconds=<n>`: how long one `execute` may take before its process is
    /// killed and replaced, its requests failed (default: no limit; a model's
    /// `EXECUTE_TIMEOUT_SECONDS` parameter overrides it).
    pub execute_timeout: Option<Duration>,
    /// `--backend-directory`: where Python-based backends are (`<dir>/<name>/model.py`).
    pub backend_directory: PathBuf,
}

impl Default for PythonSettings {
    fn default() -> Self {
        PythonSettings {
            executable: None,
            stub_timeout: Duration::from_secs(30),
            envs_dir: std::env::temp_dir().join("ferry-python-envs"),
            execute_timeout: None,
            backend_directory: PathBuf::from("backends"),
        }
    }
}

pub struct PythonBackend {
    settings: PythonSettings,
    host: HostSlot,
    runtime: tokio::runtime::Handle,
    /// The stub's files, written once into a private folder (shared by Python-based backends).
    stub: Arc<OnceLock<std::result::Result<tempfile::TempDir, String>>>,
    restarts: Arc<AtomicU64>,
    /// A Python-based backend: its name, and the `model.py` every model of it runs.
    based: Option<(&'static str, Based)>,
}

/// The `model.py` of a Python-based backend.
#[derive(Clone)]
enum Based {
    /// `<backend directory>/<name>/model.py`.
    File(PathBuf),
    /// One ferry carries (the PyTorch backend's), written beside the stub as `file`.
    Builtin { file: &'static str, script: &'static str },
}

/// How to start (and restart) the processes of one instance.
pub(crate) struct Launch {
    model: String,
    version: String,
    model_dir: PathBuf,
    model_path: PathBuf,
    python: PathBuf,
    stub_dir: PathBuf,
    config_json: String,
    device: Device,
    timeout: Duration,
    /// How long one `execute` may take before its process is killed and replaced (None: no limit).
    pub execute_timeout: Option<Duration>,
    /// The model runs one instance in all.
    single_instance: bool,
    /// Each instance's name, as Triton forms it: `<group name>_<index in the group>`.
    instance_names: Vec<String>,
    host: HostSlot,
    runtime: tokio::runtime::Handle,
    restarts: Arc<AtomicU64>,
}

impl Launch {
    /// A new process with the model initialized in it.
    fn spawn(&self, index: usize) -> Result<Process> {
        let mut p = Process::start(&self.python, &self.stub_dir, &self.model, &self.model_dir, self.timeout)?;
        let (kind, device_id) = match self.device {
            Device::Gpu(id) => ("GPU", id),
            Device::Cpu => ("CPU", 0),
        };
        let args = json!({
            "model_config": self.config_json,
            "model_instance_kind": kind,
            "model_instance_name": self.instance_names.get(index).cloned().unwrap_or_else(|| format!("{}_{index}", self.model)),
            "model_instance_device_id": device_id.to_string(),
            "model_repository": self.model_dir.display().to_string(),
            "model_version": self.version,
            "model_name": self.model,
        });
        let msg = json!({"op": "initialize", "model_path": self.model_path.display().to_string(), "args": args});
        self.request(&mut p, &msg, "initialize", &args["model_instance_name"])?;
        Ok(p)
    }

    /// Sends one control message and waits (up to the stub timeout) for its reply.
    fn request(&self, p: &mut Process, msg: &serde_json::Value, what: &str, stub: &Value) -> Result<serde_json::Value> {
        let fail = |e: String| Error::unavailable(format!("model '{}': {what} failed: {e}", self.model));
        p.writer.send(msg, &[]).map_err(|e| fail(e.to_string()))?;
        // The timeout bounds the whole call, however many log lines come meanwhile.
        let deadline = std::time::Instant::now() + self.timeout;
        let reply = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(fail(format!("no answer within {} s", self.timeout.as_secs())));
            }
            p.set_timeout(Some(left));
            match p.recv() {
                Ok((m, _)) if m["op"] == "log" => bls::log(&self.model, &m),
                Ok((m, _)) if m["op"] == "done" => break m,
                Ok((m, _)) => tracing::warn!(model = %self.model, op = %m["op"], "unexpected message during {what}"),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Err(fail(format!("no answer within {} s", self.timeout.as_secs())));
                }
                Err(e) => {
                    // The log gets all it printed; the error its last line (its exception, as a rule).
                    let (status, said) = p.death();
                    // Triton's words first (its tests and users grep for them).
                    let stub = stub.as_str().unwrap_or(&self.model);
                    tracing::error!(model = %self.model, status = %status, "Stub process '{stub}' is not healthy. The Python process died during {what}: {said}");
                    let last = said.rsplit(" | ").next().unwrap_or_default();
                    return Err(fail(format!("{e}; the process {status}: {last}")));
                }
            }
        };
        p.set_timeout(None);
        match reply["error"].as_str() {
            Some(e) => {
                tracing::debug!(model = %self.model, trace = reply["trace"].as_str().unwrap_or_default(), "{what} raised");
                Err(fail(e.to_string()))
            }
            None => Ok(reply),
        }
    }

    fn host_call(&self, call: bls::HostCall, writer: process::Writer) {
        let host = self.host.get().and_then(std::sync::Weak::upgrade);
        let alone = self.single_instance.then_some(self.model.as_str());
        bls::serve(call, (host, alone), &self.runtime, writer);
    }
}

/// A model's `EXECUTE_TIMEOUT_SECONDS` parameter (0: no limit).
fn execute_timeout(config: &ModelConfig) -> Result<Option<Duration>> {
    let Some(p) = config.parameters.get("EXECUTE_TIMEOUT_SECONDS") else { return Ok(None) };
    let v = p.string_value.trim();
    match v.parse::<f64>() {
        Ok(0.0) => Ok(Some(Duration::MAX)),
        Ok(s) if s > 0.0 && s <= 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        _ => Err(Error::invalid(format!(
            "model '{}': parameter 'EXECUTE_TIMEOUT_SECONDS' is '{v}'; expected seconds (0: no limit)",
            config.name
        ))),
    }
}

/// The instances' names in the order the loader makes them (group by group, each GPU of a
/// KIND_GPU group in turn): `<group name>_<k>`, k counting within the group, as Triton's.
fn instance_names(config: &ModelConfig) -> Vec<String> {
    let kind_gpu = crate::proto::inference::model_instance_group::Kind::Gpu as i32;
    let mut names = Vec::new();
    for g in &config.instance_group {
        let devices = if g.kind == kind_gpu { g.gpus.len().max(1) } else { 1 };
        let n = g.count.max(0) as usize * devices;
        names.extend((0..n).map(|k| format!("{}_{k}", g.name)));
    }
    names
}

/// How many instances the config runs (KIND_GPU groups once per GPU listed).
fn instances(config: &ModelConfig) -> i64 {
    let kind_gpu = crate::proto::inference::model_instance_group::Kind::Gpu as i32;
    let per_group = |g: &crate::proto::inference::ModelInstanceGroup| {
        i64::from(g.count.max(0)) * if g.kind == kind_gpu { g.gpus.len().max(1) as i64 } else { 1 }
    };
    if config.instance_group.is_empty() { 1 } else { config.instance_group.iter().map(per_group).sum() }
}

/// Whether the default Python (`--backend-config python,executable=`, else `python3`) runs and
/// has numpy; the reason when not.
pub fn default_python_usable(settings: &PythonSettings) -> std::result::Result<(), String> {
    let python = settings.executable.clone().unwrap_or_else(|| PathBuf::from("python3"));
    let out = std::process::Command::new(&python)
        .args(["-c", "import sys, numpy; assert sys.version_info >= (3, 9)"])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run '{}': {e}", python.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(format!("'{}' has no numpy or is older than 3.9 ({})", python.display(), err.lines().last().unwrap_or("")))
    }
}

impl PythonBackend {
    pub fn new(settings: PythonSettings, host: HostSlot, runtime: tokio::runtime::Handle) -> Self {
        PythonBackend { settings, host, runtime, stub: Arc::default(), restarts: Arc::default(), based: None }
    }

    /// The Python-based backend `name` (`<backend directory>/<name>/model.py`), when there is one.
    pub fn based_on(&self, name: &str) -> Option<PythonBackend> {
        crate::names::check_model_name(name).ok()?;
        let file = self.settings.backend_directory.join(name).join("model.py");
        if !file.is_file() {
            return None;
        }
        tracing::info!(backend = name, file = %file.display(), "a Python-based backend");
        // Names live as long as the server; one per backend folder found.
        let name: &'static str = Box::leak(name.to_string().into_boxed_str());
        Some(PythonBackend {
            settings: self.settings.clone(),
            host: Arc::clone(&self.host),
            runtime: self.runtime.clone(),
            stub: Arc::clone(&self.stub),
            restarts: Arc::clone(&self.restarts),
            based: Some((name, Based::File(file))),
        })
    }

    /// A Python-based backend whose `model.py` ferry carries (`script`, written beside the stub
    /// as `file`), run by `python` when given (else as Python models are: EXECUTION_ENV_PATH,
    /// then the Python backend's executable).
    pub fn builtin(
        &self,
        name: &'static str,
        file: &'static str,
        script: &'static str,
        python: Option<PathBuf>,
    ) -> Self {
        let mut settings = self.settings.clone();
        if python.is_some() {
            settings.executable = python;
        }
        PythonBackend {
            settings,
            host: Arc::clone(&self.host),
            runtime: self.runtime.clone(),
            stub: Arc::clone(&self.stub),
            restarts: Arc::clone(&self.restarts),
            based: Some((name, Based::Builtin { file, script })),
        }
    }

    /// The `model.py` a Python-based backend runs (a built-in one written out once).
    fn based_file(&self) -> Result<Option<PathBuf>> {
        match &self.based {
            None => Ok(None),
            Some((_, Based::File(f))) => Ok(Some(f.clone())),
            Some((_, Based::Builtin { file, script })) => {
                let path = self.stub_dir()?.join(file);
                if std::fs::read(&path).is_ok_and(|s| s == script.as_bytes()) {
                    return Ok(Some(path));
                }
                // Written whole under another name, then renamed: a concurrent load never reads half.
                static WRITES: AtomicU64 = AtomicU64::new(0);
                let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let temp = path.with_extension(format!("{}.{n}.tmp", std::process::id()));
                std::fs::write(&temp, script)
                    .and_then(|()| std::fs::rename(&temp, &path))
                    .map_err(|e| Error::internal(format!("cannot write {}: {e}", path.display())))?;
                Ok(Some(path))
            }
        }
    }

    /// Python processes started again after one died, since the server started.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn stub_dir(&self) -> Result<PathBuf> {
        let dir = self.stub.get_or_init(|| {
            let dir = tempfile::Builder::new().prefix("ferry-python-").tempdir().map_err(|e| e.to_string())?;
            std::fs::write(dir.path().join("ferry_stub.py"), STUB).map_err(|e| e.to_string())?;
            std::fs::write(dir.path().join("triton_python_backend_utils.py"), PB_UTILS).map_err(|e| e.to_string())?;
            Ok(dir)
        });
        dir.as_ref()
            .map(|d| d.path().to_path_buf())
            .map_err(|e| Error::internal(format!("cannot write the Python stub: {e}")))
    }

    fn launch(&self, model_path: &Path, config: &ModelConfig, device: Device) -> Result<Launch> {
        // Triton's Python backend refuses these in the names its processes go by.
        const INVALID: &[char] = &[
            ';', '|', '&', '$', '`', '<', '>', '(', ')', '[', ']', '{', '}', '\\', '"', '\'', '*', '?', '~', '#', '!',
        ];
        if config.name.is_empty() || config.name.contains(INVALID) {
            return Err(Error::invalid(format!(
                "Invalid stub name: contains invalid characters (model '{}'; none of {} may be in a Python model's \
                 name)",
                config.name,
                INVALID.iter().collect::<String>()
            )));
        }
        let version_dir = model_path.parent().unwrap_or(Path::new("."));
        let model_dir = version_dir.parent().unwrap_or(Path::new(".")).to_path_buf();
        // A Python-based backend's model.py runs every model of it, in the model's own folder.
        let based = self.based_file()?;
        let model_path = based.as_deref().unwrap_or(model_path);
        if !model_path.is_file() {
            return Err(Error::invalid(format!(
                "Failed to preinitialize Python stub: Python model file not found in '{}'",
                model_path.display()
            )));
        }
        Ok(Launch {
            model: config.name.clone(),
            version: version_dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default(),
            python: env::python_for(&self.settings, config, &model_dir)?,
            stub_dir: self.stub_dir()?,
            model_path: model_path.to_path_buf(),
            model_dir,
            config_json: pbtxt::to_json(config).to_string(),
            device,
            timeout: self.settings.stub_timeout,
            execute_timeout: execute_timeout(config)?.or(self.settings.execute_timeout),
            single_instance: instances(config) == 1,
            instance_names: instance_names(config),
            host: Arc::clone(&self.host),
            runtime: self.runtime.clone(),
            restarts: Arc::clone(&self.restarts),
        })
    }
}

impl Backend for PythonBackend {
    fn name(&self) -> &'static str {
        self.based.as_ref().map_or("python", |(name, _)| name)
    }

    /// A Python model declares nothing ferry could check its config against.
    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        let launch = Arc::new(self.launch(spec.model_path, spec.config, spec.device)?);
        Ok(Box::new(instance::PythonInstance::start(launch, spec.index)?))
    }

    /// Runs the model's static `auto_complete_config` (when it has one) in a short-lived process.
    fn auto_complete(&self, model_path: &Path, config: &mut ModelConfig) -> Result<()> {
        let launch = self.launch(model_path, config, Device::Cpu)?;
        let mut p = Process::start(&launch.python, &launch.stub_dir, &launch.model, &launch.model_dir, launch.timeout)?;
        let msg = json!({
            "op": "auto_complete",
            "model_path": launch.model_path.display().to_string(),
            "config": pbtxt::to_json(config),
        });
        let reply = launch.request(&mut p, &msg, "auto_complete_config", &json!(config.name))?;
        let completed = pbtxt::from_json(&reply["config"].to_string())
            .map_err(|e| Error::invalid(format!("auto_complete_config of model '{}' returned {e}", config.name)))?;
        *config = completed;
        Ok(())
    }
}
