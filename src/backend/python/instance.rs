//! One instance of a Python model: its process, the shared memory its inputs go through, and the
//! loop that answers the process's own calls (BLS, model control, log lines) while it executes.
//! A process that dies fails the batch it was running, and a new one takes its place.
use std::{
    collections::BTreeMap,
    fs::File,
    os::unix::fs::{FileExt, OpenOptionsExt},
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Value, json};

use super::{Launch, bls, link::Link, process::MAX_MESSAGE};
use crate::{
    backend::{Answer, BackendInput, BackendRequest, ModelInstance},
    error::{Error, Result},
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
            // Only this user may read what clients sent (the name is unguessable too).
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
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
    outputs: Option<(String, File, u64)>,
}

impl PythonInstance {
    pub fn start(launch: Arc<Launch>, index: usize) -> Result<PythonInstance> {
        let process = launch.spawn(index)?;
        let inputs = Region::new(format!("{}-in", process.prefix));
        let link = Link::new(process, Arc::clone(&launch))?;
        Ok(PythonInstance { launch, index, link, inputs, outputs: None })
    }

    /// Replaces a dead process; the next batch goes to the new one.
    fn restart(&mut self, why: &str) {
        let model = &self.launch.model;
        tracing::error!(model = %model, instance = self.index, reason = why, "the Python process died; starting a new one");
        self.launch.restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.launch.spawn(self.index).and_then(|p| Link::new(p, Arc::clone(&self.launch))) {
            Ok(link) => {
                self.inputs = Region::new(format!("{}-in", link.process.prefix));
                self.link = link;
                self.outputs = None;
                tracing::info!(model = %model, instance = self.index, "Python process restarted");
            }
            Err(e) => tracing::error!(model = %model, error = %e, "cannot restart the Python process"),
        }
    }

    /// The process's output region named in its reply, opened once per name, with its length.
    fn output_file(&mut self, region: &Value) -> Result<(&File, u64)> {
        let name = region[0].as_str().unwrap_or_default().to_string();
        if self.outputs.as_ref().is_none_or(|(n, _, _)| n != &name) {
            let object = crate::names::shm_object(&name).map_err(Error::internal)?;
            let file = File::open(format!("/dev/shm/{object}"))
                .and_then(|f| f.metadata().map(|m| (f, m.len())))
                .map_err(|e| Error::internal(format!("cannot open the Python process's outputs '{name}': {e}")))?;
            self.outputs = Some((name, file.0, file.1));
        }
        let (_, file, len) = self.outputs.as_ref().expect("just set");
        Ok((file, *len))
    }

    /// Every response's outputs, read from the process's region with one read of the span they
    /// cover; each tensor is a slice of that one buffer.
    fn read_responses(&mut self, region: &Value, responses: &[Value]) -> Result<Vec<Result<Answer>>> {
        fn described(resp: &Value) -> &[Value] {
            resp[0].as_array().map(Vec::as_slice).unwrap_or_default()
        }
        let mut span = 0u64;
        for o in responses.iter().flat_map(described) {
            let end = o[3].as_u64().unwrap_or(0).checked_add(o[4].as_u64().unwrap_or(0));
            span = span.max(end.ok_or_else(|| Error::internal("an output's offset and size overflow"))?);
        }
        let (file, len) = self.output_file(region)?;
        if span > len.min(MAX_MESSAGE) {
            return Err(Error::internal(format!(
                "the Python process named outputs up to byte {span} of a {len}-byte region (at most {MAX_MESSAGE} bytes are read per batch)"
            )));
        }
        let mut data = vec![0u8; span as usize];
        file.read_exact_at(&mut data, 0).map_err(|e| Error::internal(format!("cannot read the outputs: {e}")))?;
        let data = Bytes::from(data);
        let tensor = |o: &Value| -> Result<Tensor> {
            let datatype = DataType::from_wire(o[1].as_str().unwrap_or_default())
                .ok_or_else(|| Error::internal(format!("output {} has a datatype ferry does not know", o[0])))?;
            let (offset, size) = (o[3].as_u64().unwrap_or(0) as usize, o[4].as_u64().unwrap_or(0) as usize);
            Ok(Tensor {
                name: o[0].as_str().unwrap_or_default().to_string(),
                datatype,
                shape: o[2].as_array().into_iter().flatten().filter_map(Value::as_i64).collect(),
                data: data.slice(offset..offset + size),
            })
        };
        Ok(responses
            .iter()
            .map(|resp| match &resp[1] {
                Value::Null => Ok(Answer {
                    outputs: described(resp).iter().map(tensor).collect::<Result<_>>()?,
                    parameters: bls::params_of(&resp[2]),
                }),
                e => Err(super::link::error_of(e)),
            })
            .collect())
    }

    /// Writes the batch's inputs into the input region (one write when they are small) and
    /// describes each request as the stub reads it.
    fn write_inputs<'a>(&mut self, requests: &'a [BackendRequest<'a>]) -> Result<Vec<Described<'a>>> {
        let padded = |n: usize| (n as u64).div_ceil(8) * 8;
        let total: u64 = requests.iter().flat_map(|r| &r.inputs).map(|i| padded(i.data.len())).sum();
        let file = self.inputs.ensure(total.max(1))?;
        let written = |e: std::io::Error| Error::internal(format!("cannot write to shared memory: {e}"));
        let gather = total <= GATHER_LIMIT;
        let mut gathered = Vec::with_capacity(if gather { total as usize } else { 0 });
        let mut at = 0u64;
        let mut described = Vec::with_capacity(requests.len());
        for r in requests {
            let mut inputs = Vec::with_capacity(r.inputs.len());
            for i in &r.inputs {
                if gather {
                    gathered.extend_from_slice(i.data);
                    gathered.resize(gathered.len() + (padded(i.data.len()) as usize - i.data.len()), 0);
                } else {
                    file.write_all_at(i.data, at).map_err(written)?;
                }
                inputs.push(DescribedInput(i.name, i.datatype.wire(), i.shape, at, i.data.len()));
                at += padded(i.data.len());
            }
            let parameters = (!r.parameters.is_empty())
                .then(|| r.parameters.iter().map(|(k, v)| (k.as_str(), bls::param_json(v))).collect());
            described.push(Described(r.id, parameters, None, &r.outputs, inputs));
        }
        if gather {
            file.write_all_at(&gathered, 0).map_err(written)?;
        }
        // Streams are registered once nothing can fail before the batch is sent.
        for (d, r) in described.iter_mut().zip(requests) {
            d.2 = r.stream.map(|tx| self.link.register(tx));
        }
        Ok(described)
    }

    fn run(&mut self, requests: &[BackendRequest<'_>]) -> Result<Vec<Result<Answer>>> {
        // A process that died while idle is replaced before the batch goes to it (its socket
        // may close a moment before the kernel reports it exited).
        if self.link.gone_while_idle() || self.link.process.exited() {
            let (status, said) = self.link.process.death();
            self.restart(&format!("it ended while idle ({status}); it last said: {said}"));
        }
        let described = self.write_inputs(requests)?;
        let decoupled = requests.iter().any(|r| r.stream.is_some());
        let msg =
            Execute { op: "execute", region: (&self.inputs.name, self.inputs.size), requests: described, decoupled };
        // BLS calls the model makes while it runs are nested in the deepest of its requests.
        let deepest = requests.iter().map(|r| r.context).max_by_key(|c| c.nesting);
        *self.link.running.lock().unwrap_or_else(|p| p.into_inner()) = deepest.cloned().unwrap_or_default();
        let deadline = self.launch.execute_timeout.and_then(|t| std::time::Instant::now().checked_add(t));
        let sent = self.link.process.writer.send(&msg, &[]);
        // The model may ask whether a request's client is still there (`is_cancelled()`).
        let gone = |i: usize| requests.get(i).and_then(|r| r.cancelled).is_some_and(|f| f());
        let replied = sent.and_then(|()| self.link.wait(deadline, &gone));
        // The batch is over: its context (its requests' tickets) must not outlive it.
        *self.link.running.lock().unwrap_or_else(|p| p.into_inner()) = Default::default();
        let (reply, _) = match replied {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                let took = self.launch.execute_timeout.unwrap_or_default().as_secs_f64();
                self.restart(&format!("execute() did not return within {took} s"));
                return Err(Error::unavailable(format!(
                    "model '{}': execute() did not return within {took} s (EXECUTE_TIMEOUT_SECONDS, or --backend-config \
                     python,execute-timeout-seconds); its process was stopped and a new one started",
                    self.launch.model
                )));
            }
            Err(e) => {
                // What it printed last (paths, secrets) goes to the log, not to clients.
                let (status, said) = self.link.process.death();
                self.restart(&format!("{e}; {status}; it last said: {said}"));
                return Err(Error::unavailable(format!(
                    "model '{}': the Python process running this request died ({status}); a new one was started (the \
                     server log has what it printed)",
                    self.launch.model
                )));
            }
        };
        if decoupled && reply["error"].is_null() {
            // The responses stream through each request's sender.
            return Ok(requests.iter().map(|_| Ok(Answer::default())).collect());
        }
        if let Some(e) = reply["error"].as_str() {
            tracing::debug!(model = %self.launch.model, trace = reply["trace"].as_str().unwrap_or_default(), "execute raised");
            // Triton's words: what the stub sends is "<type>: <message>" of what execute raised.
            return Err(Error::internal(format!(
                "Failed to process the request(s) for model '{}', message: {e}",
                reply["instance"].as_str().unwrap_or(&self.launch.model)
            )));
        }
        let responses = reply["responses"].as_array().map(Vec::as_slice).unwrap_or_default();
        self.read_responses(&reply["region"], responses)
    }
}

/// Inputs of a batch up to this size are copied into one buffer and written with one call.
const GATHER_LIMIT: u64 = 1 << 20;

/// `execute` as the stub reads it: compact arrays, not objects, since it is sent per batch.
#[derive(Serialize)]
struct Execute<'a> {
    op: &'static str,
    region: (&'a str, u64),
    requests: Vec<Described<'a>>,
    decoupled: bool,
}

/// A request: id, parameters, stream handle, requested outputs, inputs.
#[derive(Serialize)]
struct Described<'a>(&'a str, Option<BTreeMap<&'a str, Value>>, Option<u64>, &'a [&'a str], Vec<DescribedInput<'a>>);

/// An input: name, datatype, shape, offset and size in the input region.
#[derive(Serialize)]
struct DescribedInput<'a>(&'a str, &'static str, &'a [i64], u64, usize);

impl ModelInstance for PythonInstance {
    /// The process's resident memory (the interpreter and what the model holds).
    fn memory(&self) -> Vec<crate::stats::MemoryUse> {
        let bytes = crate::stats::resident_bytes(&self.link.process.pid().to_string());
        bytes.map(|bytes| crate::stats::MemoryUse { kind: "CPU", id: 0, bytes }).into_iter().collect()
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let (parameters, context) = Default::default();
        let one = BackendRequest {
            id: "",
            parameters: &parameters,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            stream: None,
            context: &context,
            cancelled: None,
        };
        let answer = self.run(std::slice::from_ref(&one))?.pop();
        answer.unwrap_or_else(|| Err(Error::internal("no response"))).map(|a| a.outputs)
    }

    fn separate_requests(&self) -> bool {
        true
    }

    fn execute_each(&mut self, requests: &[BackendRequest<'_>]) -> Vec<Result<Answer>> {
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
        if let Some((name, _, _)) = self.outputs.take() {
            let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
        }
    }
}
