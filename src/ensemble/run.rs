//! Running an ensemble: each step is one engine call, started as soon as every tensor it reads
//! exists (independent steps run at once); tensors pass between steps as shared buffers, never
//! copied. The request's id and parameters (priority, timeout included) go to every step. The
//! first failing step fails the request with its model's name and message; dropping the future
//! (the client went away) drops the steps in flight and starts no other.
use std::{collections::HashMap, future::Future, pin::Pin};

use futures_util::{StreamExt, stream::FuturesUnordered};
use tracing::Instrument;

use super::Ensemble;
use crate::{
    error::Result,
    request::{Context, InferRequest, InferResponse, InputTensor, Parameters, RequestedOutput},
    telemetry::otel,
    tensor::Tensor,
};

pub type StepFuture<'a> = Pin<Box<dyn Future<Output = Result<InferResponse>> + Send + 'a>>;

/// What runs a step: the engine, behind the one call every front-end makes.
pub trait StepEngine: Send + Sync {
    fn infer_step(&self, req: InferRequest) -> StepFuture<'_>;
}

/// Runs the ensemble on `inputs` (by ensemble tensor name); returns every tensor it produced.
pub async fn run(
    ensemble: &Ensemble,
    engine: &dyn StepEngine,
    (id, parameters, context): (&str, &Parameters, &Context),
    inputs: Vec<Tensor>,
    span: &tracing::Span,
) -> Result<HashMap<String, Tensor>> {
    let given: Vec<String> = inputs.iter().map(|t| t.name.clone()).collect();
    let mut pool: HashMap<String, Tensor> = inputs.into_iter().map(|t| (t.name.clone(), t)).collect();
    let produced_by_steps: Vec<&str> =
        ensemble.steps.iter().flat_map(|s| s.outputs.iter().map(|(_, t)| t.as_str())).collect();
    let mut started = vec![false; ensemble.steps.len()];
    let mut running = FuturesUnordered::new();
    loop {
        for (i, step) in ensemble.steps.iter().enumerate() {
            // Ready when every tensor it reads exists; an ensemble input the client left out
            // (an optional one) is simply not passed on.
            let ready = step
                .inputs
                .iter()
                .all(|(_, t)| pool.contains_key(t) || (!given.contains(t) && !produced_by_steps.contains(&t.as_str())));
            if started[i] || !ready {
                continue;
            }
            started[i] = true;
            let req = InferRequest {
                model_name: step.model.clone(),
                model_version: step.version,
                id: id.to_string(),
                parameters: parameters.clone(),
                inputs: step
                    .inputs
                    .iter()
                    .filter_map(|(input, tensor)| {
                        let t = pool.get(tensor)?;
                        Some(InputTensor::host(input.clone(), t.datatype, t.shape.clone(), t.data.clone()))
                    })
                    .collect(),
                outputs: step
                    .outputs
                    .iter()
                    .map(|(o, _)| RequestedOutput { name: o.clone(), ..Default::default() })
                    .collect(),
                trace_parent: None,
                context: Context { namespace: ensemble.namespace, ..context.nested() },
            };
            let step_span = otel::step_span(span, i, &step.model);
            running.push(async move { (i, engine.infer_step(req).instrument(step_span).await) });
        }
        let Some((i, outcome)) = running.next().await else { break };
        let step = &ensemble.steps[i];
        let at = || format!("in ensemble '{}', step {i} (model '{}')", ensemble.name, step.model);
        let resp = outcome.map_err(|e| e.context(at()))?;
        for (out, tensor) in &step.outputs {
            let t = resp.outputs.iter().find(|t| &t.name == out).ok_or_else(|| {
                crate::error::Error::internal(format!("{}: the model returned no output '{out}'", at()))
            })?;
            pool.insert(tensor.clone(), Tensor { name: tensor.clone(), ..t.clone() });
        }
    }
    Ok(pool)
}
