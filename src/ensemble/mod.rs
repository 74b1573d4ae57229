//! Ensembles: `ensemble_scheduling` checked once at load into a DAG of steps over other models
//! (every tensor produced once, none read before it exists, no cycle, datatypes and shapes that
//! agree along every map, batch sizes the composing models allow). Running one is not a backend:
//! it is a scheduler of engine calls (`run`), so each step meets its own model's queue, batcher,
//! cache and statistics.
use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use crate::{
    proto::inference::{ModelConfig, model_config::SchedulingChoice},
    schema::Schema,
    tensor::{DataType, shape_string},
};

pub mod graph;
mod run;
pub use run::{StepEngine, StepFuture, run};

/// One step: a model (a fixed version, or the latest) and how its tensors map onto the
/// ensemble's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub model: String,
    pub version: Option<u64>,
    /// (the model's input, the ensemble tensor it reads), sorted.
    pub inputs: Vec<(String, String)>,
    /// (the model's output, the ensemble tensor it writes), sorted.
    pub outputs: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ensemble {
    pub name: String,
    pub steps: Vec<Step>,
    /// With model namespacing, the repository it was loaded from: its steps prefer that
    /// repository's models (resolved on each request, as models come and go).
    pub namespace: Option<usize>,
}

/// What the checks need to know of a composing model: its schema, when it is loaded.
pub trait Models {
    /// `namespace`: the repository whose model of that name is preferred (model namespacing).
    fn schema(&self, namespace: Option<usize>, name: &str, version: Option<u64>) -> Result<Arc<Schema>, String>;
}

/// A tensor of the ensemble: who writes it and what it holds (full shape, batch dim included).
#[derive(Debug, Clone)]
struct Known {
    /// None: an ensemble input.
    producer: Option<usize>,
    datatype: DataType,
    shape: Vec<i64>,
}

fn full_shape(batching: bool, dims: &[i64]) -> Vec<i64> {
    let mut s = if batching { vec![-1] } else { Vec::new() };
    s.extend_from_slice(dims);
    s
}

fn shapes_agree(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x == -1 || y == -1 || x == y)
}

impl Ensemble {
    /// The steps of an ensemble config, checked against each other and against the composing
    /// models (which must be loaded). Errors name the ensemble, the step and the tensor.
    pub fn plan(config: &ModelConfig, schema: &Schema, models: &dyn Models) -> Result<Ensemble, String> {
        Ensemble::plan_in(config, schema, models, None)
    }

    /// `plan` for an ensemble of repository `namespace` (model namespacing).
    pub fn plan_in(
        config: &ModelConfig,
        schema: &Schema,
        models: &dyn Models,
        namespace: Option<usize>,
    ) -> Result<Ensemble, String> {
        let name = &config.name;
        let Some(SchedulingChoice::EnsembleScheduling(es)) = &config.scheduling_choice else {
            return Err(format!("ensemble '{name}' has no ensemble_scheduling"));
        };
        if es.step.is_empty() {
            return Err(format!("ensemble '{name}' has no step"));
        }
        let sorted = |m: &HashMap<String, String>| {
            let mut v: Vec<(String, String)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort();
            v
        };
        let mut steps = Vec::with_capacity(es.step.len());
        for (i, s) in es.step.iter().enumerate() {
            let at = || format!("ensemble '{name}', step {i} (model '{}')", s.model_name);
            crate::names::check_model_name(&s.model_name).map_err(|e| format!("{}: {e}", at()))?;
            if &s.model_name == name {
                return Err(format!("{}: an ensemble cannot run itself", at()));
            }
            let version = match s.model_version {
                -1 => None,
                v if v >= 0 => Some(v as u64),
                v => return Err(format!("{}: model_version {v} must be -1 (latest) or a version number", at())),
            };
            if s.output_map.is_empty() {
                return Err(format!("{}: the step has no output_map", at()));
            }
            steps.push(Step {
                model: s.model_name.clone(),
                version,
                inputs: sorted(&s.input_map),
                outputs: sorted(&s.output_map),
            });
        }
        let ensemble = Ensemble { name: name.clone(), steps, namespace };
        let known = ensemble.check_dataflow(schema, models)?;
        ensemble.check_outputs(schema, &known)?;
        ensemble.check_acyclic(&known)?;
        Ok(ensemble)
    }

    /// The models this ensemble runs (each once).
    pub fn models(&self) -> Vec<&str> {
        let mut m: Vec<&str> = self.steps.iter().map(|s| s.model.as_str()).collect();
        m.sort_unstable();
        m.dedup();
        m
    }

    fn at(&self, i: usize) -> String {
        format!("ensemble '{}', step {i} (model '{}')", self.name, self.steps[i].model)
    }

    /// Every tensor written once, read only once written, with agreeing types along the maps.
    fn check_dataflow(&self, schema: &Schema, models: &dyn Models) -> Result<BTreeMap<String, Known>, String> {
        let mut known: BTreeMap<String, Known> = BTreeMap::new();
        for spec in &schema.inputs {
            let shape = full_shape(schema.batching(), &spec.dims);
            known.insert(spec.name.clone(), Known { producer: None, datatype: spec.datatype, shape });
        }
        let mut model_schemas = Vec::with_capacity(self.steps.len());
        for (i, step) in self.steps.iter().enumerate() {
            let m =
                models.schema(self.namespace, &step.model, step.version).map_err(|e| format!("{}: {e}", self.at(i)))?;
            if schema.batching() && m.max_batch_size < schema.max_batch_size {
                return Err(format!(
                    "{}: the ensemble's max_batch_size is {} but the model allows {}",
                    self.at(i),
                    schema.max_batch_size,
                    m.max_batch_size
                ));
            }
            for (out, tensor) in &step.outputs {
                let spec = m.outputs.iter().find(|o| &o.name == out).ok_or_else(|| {
                    format!("{}: output_map names '{out}', which is not an output of the model", self.at(i))
                })?;
                if let Some(k) = known.get(tensor) {
                    let first = k.producer.map_or("an ensemble input".to_string(), |p| format!("step {p}"));
                    return Err(format!("{}: tensor '{tensor}' is produced twice (also by {first})", self.at(i)));
                }
                let shape = full_shape(m.batching(), &spec.dims);
                known.insert(tensor.clone(), Known { producer: Some(i), datatype: spec.datatype, shape });
            }
            model_schemas.push(m);
        }
        for (i, (step, m)) in self.steps.iter().zip(&model_schemas).enumerate() {
            for (input, tensor) in &step.inputs {
                let spec = m.inputs.iter().find(|s| &s.name == input).ok_or_else(|| {
                    format!("{}: input_map names '{input}', which is not an input of the model", self.at(i))
                })?;
                let k = known.get(tensor).ok_or_else(|| {
                    format!("{}: input '{input}' reads tensor '{tensor}', which no step produces and is not an ensemble input", self.at(i))
                })?;
                agree(
                    &self.at(i),
                    &format!("input '{input}' (tensor '{tensor}')"),
                    k,
                    spec.datatype,
                    &full_shape(m.batching(), &spec.dims),
                )?;
            }
            if let Some(missing) =
                m.inputs.iter().find(|s| !s.optional && !step.inputs.iter().any(|(n, _)| n == &s.name))
            {
                return Err(format!(
                    "{}: the model's input '{}' is not in the step's input_map",
                    self.at(i),
                    missing.name
                ));
            }
        }
        Ok(known)
    }

    fn check_outputs(&self, schema: &Schema, known: &BTreeMap<String, Known>) -> Result<(), String> {
        for spec in &schema.outputs {
            let k = known.get(&spec.name).filter(|k| k.producer.is_some()).ok_or_else(|| {
                format!("ensemble '{}': output '{}' is never produced by any step", self.name, spec.name)
            })?;
            let at = format!("ensemble '{}', step {}", self.name, k.producer.unwrap_or(0));
            agree(
                &at,
                &format!("ensemble output '{}'", spec.name),
                k,
                spec.datatype,
                &full_shape(schema.batching(), &spec.dims),
            )?;
        }
        Ok(())
    }

    /// Steps in an order where every step comes after those it reads from; a cycle is an error.
    fn check_acyclic(&self, known: &BTreeMap<String, Known>) -> Result<(), String> {
        let deps: Vec<Vec<usize>> = self
            .steps
            .iter()
            .map(|s| s.inputs.iter().filter_map(|(_, t)| known.get(t).and_then(|k| k.producer)).collect())
            .collect();
        let mut done = vec![false; self.steps.len()];
        loop {
            let ready: Vec<usize> =
                (0..self.steps.len()).filter(|&i| !done[i] && deps[i].iter().all(|&d| done[d])).collect();
            if ready.is_empty() {
                break;
            }
            ready.into_iter().for_each(|i| done[i] = true);
        }
        match (0..self.steps.len()).filter(|&i| !done[i]).collect::<Vec<_>>() {
            stuck if stuck.is_empty() => Ok(()),
            stuck => {
                Err(format!("ensemble '{}': steps {stuck:?} form a cycle (each waits for another's output)", self.name))
            }
        }
    }
}

fn agree(at: &str, what: &str, k: &Known, datatype: DataType, shape: &[i64]) -> Result<(), String> {
    if k.datatype != datatype {
        return Err(format!(
            "{at}: {what} is {} but the tensor mapped to it is {}",
            datatype.wire(),
            k.datatype.wire()
        ));
    }
    if !shapes_agree(&k.shape, shape) {
        return Err(format!(
            "{at}: {what} has shape {} but the tensor mapped to it has shape {}",
            shape_string(shape),
            shape_string(&k.shape)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
