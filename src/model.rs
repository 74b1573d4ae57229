//! A loaded model version as the core sees it: its effective config and schema, how it runs
//! (its scheduler, or an ensemble's steps), its statistics, and what the front-ends read of it.
use std::sync::Arc;

use crate::{ensemble::Ensemble, proto::inference::ModelConfig, scheduler::Scheduler, schema::Schema, stats::Stats};

/// How a version runs its requests: its own scheduler and instances, or, for an ensemble, one
/// engine call per step.
pub enum Runner {
    Scheduler(Scheduler),
    Ensemble(Arc<Ensemble>),
}

/// A version that is loaded and can serve. Dropping the last reference stops nothing by itself:
/// the registry calls `retire` when the version leaves service.
pub struct ModelVersion {
    pub name: String,
    /// With model namespacing, the repository the model was loaded from: its index among the
    /// server's repositories, and the repository as given (metrics label it).
    pub namespace: Option<(usize, Arc<str>)>,
    pub version: u64,
    pub config: Arc<ModelConfig>,
    pub schema: Arc<Schema>,
    pub runner: Runner,
    /// The sequence batcher of a `sequence_batching` model (slots, implicit state).
    pub sequences: Option<Arc<crate::scheduler::sequence::Sequences>>,
    pub stats: Arc<Stats>,
    /// Every instance reads and writes GPU memory directly (CUDA shared-memory inputs and
    /// outputs stay on the device).
    pub device_io: bool,
    /// The chat template saved beside the model (`tokenizer_config.json`), for the OpenAI API.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// A digest of what the version computes with (its files and effective config), for the
    /// response cache's keys; empty when the cache does not serve it.
    pub content: String,
}

/// A chat template (Jinja) and the tokens it may name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    pub template: String,
    pub bos_token: String,
    pub eos_token: String,
}

impl ModelVersion {
    /// What metadata reports as the platform: `platform`, else `backend`.
    pub fn platform(&self) -> &str {
        if self.config.platform.is_empty() { &self.config.backend } else { &self.config.platform }
    }

    /// Stops taking requests, lets admitted ones finish, and releases the instances.
    pub fn retire(&self) {
        if let Runner::Scheduler(s) = &self.runner {
            s.stop();
        }
    }

    /// The ensemble this version runs, if it is one.
    pub fn ensemble(&self) -> Option<&Arc<Ensemble>> {
        match &self.runner {
            Runner::Ensemble(e) => Some(e),
            Runner::Scheduler(_) => None,
        }
    }
}
