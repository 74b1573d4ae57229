//! Triton's `identity` backend: output i is a copy of input i. For tests and smoke checks of the
//! server path without a model runtime.
use std::path::Path;

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
}

impl Backend for IdentityBackend {
    fn name(&self) -> &'static str {
        "identity"
    }

    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        Ok(Box::new(IdentityInstance { outputs: spec.config.output.iter().map(|o| o.name.clone()).collect() }))
    }
}

impl ModelInstance for IdentityInstance {
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
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
