//! One instance of a Python model: its process, the shared memory its inputs go through, and the
//! loop that answers the process's own calls (BLS, model control, log lines) while it executes.
//! A process that dies fails the batch it was running, and a new one takes its place.
use std::{collections::BTreeMap, fs::File, os::unix::fs::FileExt, sync::Arc, time::Duration};

use bytes::Bytes;
use serde_json::{Value, json};

use super::{Launch, bls, link::Link};
use crate::{
    backend::{BackendInput, BackendRequest, ModelInstance},
    error::{Error, ErrorKind, Result},
    tensor::{DataType, Tensor},
};

/// Shared memory ferry writes a batch's inputs into; replaced by a larger one when needed.
struct Region {
    prefix: String,
    generation: u64,
    name: String,
    size: u64,
    file: Option<File>,
}

impl Region {
    fn new(prefix: String) -> Self {
        Region { prefix, generation: 0, name: String::new(), size: 0, file: None }
    }

    fn ensure(&mut self, size: u64) -> Result<&File> {
        if self.file.is_none() || size > self.size {
            let size = size.max(self.size * 2).max(1 << 20);
            self.generation += 1;
            let name = format!("{}-{}", self.prefix, self.generation);
            let path = format!("/dev/shm/{name}");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .and_then(|f| f.set_len(size).map(|()| f))
                .map_err(|e| Error::internal(format!("cannot create shared memory {path}: {e}")))?;
            self.drop_file();
            (self.name, self.size, self.file) = (name, size, Some(file));
        }
        self.file.as_ref().ok_or_else(|| Error::internal("no shared memory region"))
    }

    fn drop_file(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(format!("/dev/shm/{}", self.name));
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.drop_file();
    }
}

pub struct PythonInstance {
    launch: Arc<Launch>,
    index: usize,
    link: Link,
    inputs: Region,
    /// The process's output region, opened by name.
    outputs: Option<(String, File)>,
}

fn error_of(e: &Value, model: &str) -> Error {
    let message = e["message"].as_str().unwrap_or("the model reported an error").to_string();
    let kind = match e["code"].as_u64() {
        Some(2) => ErrorKind::NotFound,
        Some(3) => ErrorKind::InvalidArgument,
        Some(4) => ErrorKind::Unavailable,
        Some(5) => ErrorKind::Unsupported,
        Some(6) => ErrorKind::AlreadyExists,
        Some(7) => ErrorKind::Cancelled,
        _ => ErrorKind::InvalidArgument,
    };
    let _ = model;
    Error::new(kind, message)
}

impl PythonInstance {
    pub fn start(launch: Arc<Launch>, index: usize) -> Result<PythonInstance> {
        let process = launch.spawn(index)?;
        let prefix = format!("ferry-in-{}-{}", std::process::id(), process.pid());
        let link = Link::new(process, Arc::clone(&launch))?;
        Ok(PythonInstance { launch, index, link, inputs: Region::new(prefix), outputs: None })
    }

    /// Replaces a dead process; the next batch goes to the new one.
    fn restart(&mut self, why: &str) {
        let model = &self.launch.model;
        tracing::error!(model = %model, instance = self.index, reason = why, "the Python process died; starting a new one");
        self.launch.restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.launch.spawn(self.index).and_then(|p| Link::new(p, Arc::clone(&self.launch))) {
            Ok(link) => {
                self.link = link;
                self.outputs = None;
                tracing::info!(model = %model, instance = self.index, "Python process restarted");
            }
            Err(e) => tracing::error!(model = %model, error = %e, "cannot restart the Python process"),
        }
    }

    fn output_file(&mut self, region: &Value) -> Result<&File> {
        let name = region["name"].as_str().unwrap_or_default().to_string();
        if self.outputs.as_ref().is_none_or(|(n, _)| n != &name) {
            let object = crate::names::shm_object(&name).map_err(Error::internal)?;
            let file = File::open(format!("/dev/shm/{object}"))
                .map_err(|e| Error::internal(format!("cannot open the Python process's outputs '{name}': {e}")))?;
            self.outputs = Some((name, file));
        }
        Ok(&self.outputs.as_ref().expect("just set").1)
    }

    fn read_outputs(&mut self, region: &Value, outs: &Value) -> Result<Vec<Tensor>> {
        let file = self.output_file(region)?;
        let mut tensors = Vec::new();
        for o in outs.as_array().into_iter().flatten() {
            let datatype = DataType::from_wire(o["datatype"].as_str().unwrap_or_default())
                .ok_or_else(|| Error::internal(format!("output '{}' has a datatype ferry does not know", o["name"])))?;
            let (offset, size) = (o["offset"].as_u64().unwrap_or(0), o["size"].as_u64().unwrap_or(0));
            let mut data = vec![0u8; size as usize];
            file.read_exact_at(&mut data, offset)
                .map_err(|e| Error::internal(format!("cannot read an output: {e}")))?;
            tensors.push(Tensor {
                name: o["name"].as_str().unwrap_or_default().to_string(),
                datatype,
                shape: o["shape"].as_array().into_iter().flatten().filter_map(Value::as_i64).collect(),
                data: Bytes::from(data),
            });
        }
        Ok(tensors)
    }

    fn run(&mut self, requests: &[BackendRequest<'_>]) -> Result<Vec<Result<Vec<Tensor>>>> {
        let total: u64 = requests.iter().flat_map(|r| &r.inputs).map(|i| (i.data.len() as u64).div_ceil(8) * 8).sum();
        let file = self.inputs.ensure(total.max(1))?;
        let mut at = 0u64;
        let mut described = Vec::with_capacity(requests.len());
        for r in requests {
            let mut inputs = Vec::with_capacity(r.inputs.len());
            for i in &r.inputs {
                file.write_all_at(i.data, at)
                    .map_err(|e| Error::internal(format!("cannot write to shared memory: {e}")))?;
                inputs.push(json!({"name": i.name, "datatype": i.datatype.wire(), "shape": i.shape, "offset": at, "size": i.data.len()}));
                at += (i.data.len() as u64).div_ceil(8) * 8;
            }
            let parameters: BTreeMap<&str, Value> =
                r.parameters.iter().map(|(k, v)| (k.as_str(), bls::param_json(v))).collect();
            let handle = r.stream.map(|tx| self.link.register(tx));
            described.push(
                json!({"id": r.id, "parameters": parameters, "inputs": inputs, "outputs": r.outputs, "handle": handle}),
            );
        }
        let decoupled = requests.iter().any(|r| r.stream.is_some());
        let region = json!({"name": self.inputs.name, "size": self.inputs.size});
        let msg = json!({"op": "execute", "region": region, "requests": described, "decoupled": decoupled});
        let sent = self.link.process.writer.send(&msg, &[]);
        let (reply, _) = match sent.and_then(|()| self.link.reply(None)) {
            Ok(r) => r,
            Err(e) => {
                let why = format!("{e}; {}", self.link.process.death());
                self.restart(&why);
                return Err(Error::unavailable(format!(
                    "model '{}': the Python process running this request died ({why}); a new one was started",
                    self.launch.model
                )));
            }
        };
        if decoupled && reply["error"].is_null() {
            // The responses stream through each request's sender.
            return Ok(requests.iter().map(|_| Ok(Vec::new())).collect());
        }
        if let Some(e) = reply["error"].as_str() {
            tracing::debug!(model = %self.launch.model, trace = reply["trace"].as_str().unwrap_or_default(), "execute raised");
            return Err(Error::internal(format!("model '{}': execute() raised {e}", self.launch.model)));
        }
        let region = reply["region"].clone();
        reply["responses"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|resp| match &resp["error"] {
                Value::Null => Ok(self.read_outputs(&region, &resp["outputs"])),
                e => Ok(Err(error_of(e, &self.launch.model))),
            })
            .collect()
    }
}

impl ModelInstance for PythonInstance {
    /// The process's resident memory (the interpreter and what the model holds).
    fn memory(&self) -> Vec<crate::stats::MemoryUse> {
        let bytes = crate::stats::resident_bytes(&self.link.process.pid().to_string());
        bytes.map(|bytes| crate::stats::MemoryUse { kind: "CPU", id: 0, bytes }).into_iter().collect()
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let parameters = Default::default();
        let one = BackendRequest {
            id: "",
            parameters: &parameters,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            stream: None,
        };
        self.run(std::slice::from_ref(&one))?.pop().unwrap_or_else(|| Err(Error::internal("no response")))
    }

    fn separate_requests(&self) -> bool {
        true
    }

    fn execute_each(&mut self, requests: &[BackendRequest<'_>]) -> Vec<Result<Vec<Tensor>>> {
        match self.run(requests) {
            Ok(mut each) => {
                each.resize_with(requests.len(), || Err(Error::internal("the model gave no response to this request")));
                each
            }
            Err(e) => requests.iter().map(|_| Err(e.clone())).collect(),
        }
    }
}

impl Drop for PythonInstance {
    fn drop(&mut self) {
        // finalize(), briefly; the process is killed after.
        if self.link.process.writer.send(&json!({"op": "finalize"}), &[]).is_ok() {
            let _ = self.link.reply(Some(Duration::from_secs(5)));
        }
        if let Some((name, _)) = self.outputs.take() {
            let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
        }
    }
}
