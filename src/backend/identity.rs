//! Triton's `identity` backend: output i is a copy of input i. For tests and smoke checks of the
//! server path without a model runtime; its `execute_delay_ms` parameter (as Triton's) makes each
//! execution take that long, for tests of queues and cancellation.
use std::{path::Path, time::Duration};

use bytes::Bytes;

use super::{Backend, BackendInput, InstanceSpec, ModelInstance, ModelIo};
use crate::{
    error::{Error, Result},
    tensor::Tensor,
};

pub struct IdentityBackend;

struct IdentityInstance {
    /// Config output names, by position; output i echoes input i.
    outputs: Vec<String>,
    delay: Duration,
}

/// Longest `execute_delay_ms` taken (an hour).
const MAX_DELAY_MS: u64 = 3_600_000;

impl Backend for IdentityBackend {
    fn name(&self) -> &'static str {
        "identity"
    }

    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        let config = spec.config;
        let delay = match config.parameters.get("execute_delay_ms").map(|p| p.string_value.trim()) {
            None => 0,
            Some(v) => v.parse::<u64>().ok().filter(|&ms| ms <= MAX_DELAY_MS).ok_or_else(|| {
                Error::invalid(format!(
                    "model '{}': parameter 'execute_delay_ms' is '{v}'; expected milliseconds, at most {MAX_DELAY_MS}",
                    config.name
                ))
            })?,
        };
        Ok(Box::new(IdentityInstance {
            outputs: config.output.iter().map(|o| o.name.clone()).collect(),
            delay: Duration::from_millis(delay),
        }))
    }
}

impl ModelInstance for IdentityInstance {
    fn runs_anywhere(&self) -> bool {
        self.delay.is_zero()
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        std::thread::sleep(self.delay);
        outputs
            .iter()
            .map(|name| {
                let i = self
                    .outputs
                    .iter()
                    .position(|o| o == name)
                    .ok_or_else(|| Error::internal(format!("identity backend has no output '{name}'")))?;
                let input = inputs
                    .get(i)
                    .ok_or_else(|| Error::internal(format!("identity backend: output '{name}' has no input {i}")))?;
                Ok(Tensor {
                    name: (*name).to_string(),
                    datatype: input.datatype,
                    shape: input.shape.to_vec(),
                    data: Bytes::copy_from_slice(input.data),
                })
            })
            .collect()
    }
}
