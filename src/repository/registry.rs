//! Which model versions exist, their states, and the ones serving. Swaps are atomic: a new set of
//! versions replaces the old one under one write lock, and the replaced versions are handed back
//! to be retired once their admitted requests finish.
use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard},
};

use crate::{
    error::{Error, Result},
    model::ModelVersion,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Unknown,
    Ready,
    Unavailable,
    Loading,
    Unloading,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Unknown => "UNKNOWN",
            State::Ready => "READY",
            State::Unavailable => "UNAVAILABLE",
            State::Loading => "LOADING",
            State::Unloading => "UNLOADING",
        }
    }
}

/// One row of the repository index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub name: String,
    /// None: the model was never loaded.
    pub version: Option<u64>,
    pub state: State,
    pub reason: String,
}

#[derive(Default)]
struct Slot {
    state: Option<State>,
    reason: String,
    serving: Option<Arc<ModelVersion>>,
}

#[derive(Default)]
struct Entry {
    versions: BTreeMap<u64, Slot>,
    /// A failure that concerns the whole model (its config), shown when it has no versions.
    reason: Option<String>,
    /// Unloaded on purpose: strict readiness does not wait for it.
    unloaded: bool,
}

/// With model namespacing (`--model-namespacing`), a model registers as `<root>::<name>`, `root`
/// the index of its repository; a name alone addresses it while no other repository's model has
/// that name.
pub fn qualified(root: usize, name: &str) -> String {
    format!("{root}::{name}")
}

/// The repository index and the name of a qualified key; None: `key` is not one.
pub fn split_qualified(key: &str) -> Option<(usize, &str)> {
    let (root, name) = key.split_once("::")?;
    let digits = !root.is_empty() && root.len() <= 6 && root.bytes().all(|b| b.is_ascii_digit());
    if !digits || name.is_empty() {
        return None;
    }
    Some((root.parse().ok()?, name))
}

/// `name` (under `key`) in `models`.
fn lookup(
    models: &BTreeMap<String, Entry>,
    (key, name): (&str, &str),
    version: Option<u64>,
) -> Result<Arc<ModelVersion>> {
    let unknown = || Error::not_found(format!("Request for unknown model: '{name}' is not found"));
    let entry = models.get(key).ok_or_else(unknown)?;
    match version {
        Some(v) => {
            let slot = entry.versions.get(&v).ok_or_else(|| {
                Error::not_found(format!("Request for unknown model: '{name}' version {v} is not found"))
            })?;
            slot.serving.clone().ok_or_else(|| {
                Error::unavailable(format!("Request for unknown model: '{name}' version {v} is not at ready state"))
            })
        }
        None => entry.versions.values().rev().find_map(|s| s.serving.clone()).ok_or_else(|| match &entry.reason {
            Some(reason) if entry.versions.is_empty() => {
                Error::unavailable(format!("Request for unknown model: '{name}' is not available: {reason}"))
            }
            _ => Error::not_found(format!("Request for unknown model: '{name}' has no available versions")),
        }),
    }
}

/// The key a name addresses with namespacing on: a qualified key the registry knows is itself;
/// the model of that name in repository `from` (an ensemble step's own), while it is there;
/// otherwise the one model of that name serving or meant to, else the one of that name at all.
/// Several: Triton's ambiguity error.
fn key_for<'a>(models: &'a BTreeMap<String, Entry>, from: Option<usize>, name: &'a str) -> Result<&'a str> {
    if let Some((key, _)) = models.get_key_value(name)
        && split_qualified(name).is_some()
    {
        return Ok(key);
    }
    let serves = |e: &Entry| e.versions.values().any(|s| s.serving.is_some());
    // The step's own repository's model, once it serves (while it loads, the model the step ran
    // on keeps serving it).
    if let Some(root) = from
        && let Some((key, e)) = models.get_key_value(&qualified(root, name))
        && !e.unloaded
        && serves(e)
    {
        return Ok(key);
    }
    let plain = name;
    let named = || models.iter().filter(move |(k, _)| split_qualified(k).map_or(k.as_str(), |(_, n)| n) == plain);
    // Serving ones first, then those meant to serve, then any.
    let pick = |keep: &dyn Fn(&Entry) -> bool| -> (usize, Option<&'a str>) {
        let mut it = named().filter(|(_, e)| keep(e)).map(|(k, _)| k.as_str());
        let first = it.next();
        (first.map_or(0, |_| 1 + it.count()), first)
    };
    let (count, first) = match pick(&|e| !e.unloaded && serves(e)) {
        (0, _) => match pick(&|e| !e.unloaded) {
            (0, _) => pick(&|_| true),
            other => other,
        },
        other => other,
    };
    match (count, first) {
        (0, _) | (_, None) => Ok(name),
        (1, Some(one)) => Ok(one),
        (many, _) => Err(Error::invalid(format!(
            "There are {many} identifiers of model '{plain}' in global map, model namespace must be provided to resolve ambiguity."
        ))),
    }
}

/// Why an ensemble cannot run now: the first of its composing models (nested ensembles
/// included) that is not ready.
fn blocked(models: &BTreeMap<String, Entry>, namespacing: bool, v: &ModelVersion, depth: usize) -> Option<String> {
    let ensemble = v.ensemble()?;
    for step in &ensemble.steps {
        let found =
            if namespacing { key_for(models, ensemble.namespace, &step.model) } else { Ok(step.model.as_str()) };
        match found.and_then(|key| lookup(models, (key, &step.model), step.version)) {
            Ok(inner) if depth < 8 => {
                if let Some(reason) = blocked(models, namespacing, &inner, depth + 1) {
                    return Some(reason);
                }
            }
            Ok(_) => {}
            Err(e) => return Some(format!("composing model '{}' is not ready ({})", step.model, e.message())),
        }
    }
    None
}

/// The outcome of loading one version.
pub type VersionOutcome = std::result::Result<Arc<ModelVersion>, String>;

#[derive(Default)]
pub struct Registry {
    models: RwLock<BTreeMap<String, Entry>>,
    /// `--model-namespacing`: keys are qualified by repository (`qualified`).
    namespacing: bool,
    /// The repositories (as the server was given them), by index, for namespacing.
    namespaces: Vec<Arc<str>>,
}

impl Registry {
    /// A registry with namespacing on over these repositories (`--model-namespacing`).
    pub fn namespaced(repositories: Vec<String>) -> Registry {
        Registry {
            models: RwLock::default(),
            namespacing: true,
            namespaces: repositories.into_iter().map(Into::into).collect(),
        }
    }

    /// The repository of a registry key, with namespacing on.
    pub fn namespace_of(&self, key: &str) -> Option<(usize, Arc<str>)> {
        self.root_of(key).and_then(|root| Some((root, self.namespaces.get(root).cloned()?)))
    }

    /// The model name of a registry key.
    pub fn name_of<'a>(&self, key: &'a str) -> &'a str {
        match split_qualified(key) {
            Some((_, name)) if self.namespacing => name,
            _ => key,
        }
    }

    /// The repository index of a registry key (namespacing on).
    pub fn root_of(&self, key: &str) -> Option<usize> {
        split_qualified(key).filter(|_| self.namespacing).map(|(root, _)| root)
    }

    fn key<'a>(&self, models: &'a BTreeMap<String, Entry>, name: &'a str) -> Result<&'a str> {
        self.key_from(models, None, name)
    }

    fn key_from<'a>(&self, models: &'a BTreeMap<String, Entry>, from: Option<usize>, name: &'a str) -> Result<&'a str> {
        if self.namespacing { key_for(models, from, name) } else { Ok(name) }
    }

    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<String, Entry>> {
        self.models.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, BTreeMap<String, Entry>> {
        self.models.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The version a request should run on: the one asked for, else the highest ready one. An
    /// ensemble is ready only while every model it runs is.
    pub fn resolve(&self, name: &str, version: Option<u64>) -> Result<Arc<ModelVersion>> {
        self.resolve_in(None, name, version)
    }

    /// `resolve`, preferring repository `from`'s model of that name (model namespacing: an
    /// ensemble step's own repository).
    pub fn resolve_in(&self, from: Option<usize>, name: &str, version: Option<u64>) -> Result<Arc<ModelVersion>> {
        let models = self.read();
        let key = self.key_from(&models, from, name)?;
        let found = lookup(&models, (key, self.name_of(name)), version)?;
        match blocked(&models, self.namespacing, &found, 0) {
            None => Ok(found),
            Some(reason) => Err(Error::unavailable(format!("ensemble '{name}' is not ready: {reason}"))),
        }
    }

    /// Every serving version of one model (ascending), or of all models (by name).
    pub fn serving(&self, name: Option<&str>) -> Vec<Arc<ModelVersion>> {
        let models = self.read();
        let key = match name.map(|n| self.key(&models, n)) {
            Some(Err(_)) => return Vec::new(),
            Some(Ok(k)) => Some(k),
            None => None,
        };
        models
            .iter()
            .filter(|(n, _)| key.is_none_or(|want| want == n.as_str()))
            .flat_map(|(_, e)| e.versions.values().filter_map(|s| s.serving.clone()))
            .collect()
    }

    /// Every serving ensemble version, with its model's name.
    pub fn ensembles(&self) -> Vec<(String, Arc<crate::ensemble::Ensemble>)> {
        let models = self.read();
        let versions = models.iter().flat_map(|(n, e)| e.versions.values().map(move |s| (self.name_of(n), s)));
        versions.filter_map(|(n, s)| Some((n.to_string(), Arc::clone(s.serving.as_ref()?.ensemble()?)))).collect()
    }

    /// Every model the registry knows and that was not unloaded on purpose, by name.
    pub fn names(&self) -> Vec<String> {
        self.read().iter().filter(|(_, e)| !e.unloaded).map(|(n, _)| n.clone()).collect()
    }

    /// Whether the model of this registry key serves some version (no name resolution).
    pub fn serves(&self, key: &str) -> bool {
        self.read().get(key).is_some_and(|e| e.versions.values().any(|s| s.serving.is_some()))
    }

    /// The keys a name stands for in the load API: itself, or with namespacing (a name alone)
    /// every repository's model of that name.
    pub fn keys_named(&self, name: &str) -> Vec<String> {
        if !self.namespacing || split_qualified(name).is_some() {
            return vec![name.to_string()];
        }
        let models = self.read();
        models.keys().filter(|k| self.name_of(k) == name).cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        let models = self.read();
        self.key(&models, name).is_ok_and(|key| models.contains_key(key))
    }

    /// Strict readiness: every known version ready (ensembles with their composing models),
    /// except models unloaded on purpose.
    pub fn all_ready(&self) -> bool {
        let models = self.read();
        models.values().filter(|e| !e.unloaded).all(|e| {
            e.reason.is_none()
                && e.versions.values().all(|s| {
                    s.state == Some(State::Ready)
                        && s.serving.as_ref().is_some_and(|v| blocked(&models, self.namespacing, v, 0).is_none())
                })
        })
    }

    pub fn index(&self) -> Vec<IndexEntry> {
        let models = self.read();
        let mut out = Vec::new();
        for (key, e) in models.iter() {
            let name = &self.name_of(key).to_string();
            if e.versions.is_empty() {
                let state = if e.reason.is_some() { State::Unavailable } else { State::Unknown };
                out.push(IndexEntry {
                    name: name.clone(),
                    version: None,
                    state,
                    reason: e.reason.clone().unwrap_or_default(),
                });
            }
            for (v, s) in &e.versions {
                let waiting = s.serving.as_ref().and_then(|m| blocked(&models, self.namespacing, m, 0));
                let (state, reason) = match waiting {
                    Some(why) => (State::Unavailable, why),
                    None => (s.state.unwrap_or(State::Unknown), s.reason.clone()),
                };
                out.push(IndexEntry { name: name.clone(), version: Some(*v), state, reason });
            }
        }
        out
    }

    /// Marks versions as loading (those already serving keep serving).
    pub fn mark_loading(&self, name: &str, versions: &[u64]) {
        let mut models = self.write();
        let entry = models.entry(name.to_string()).or_default();
        entry.unloaded = false;
        for v in versions {
            let slot = entry.versions.entry(*v).or_default();
            if slot.serving.is_none() {
                slot.state = Some(State::Loading);
                slot.reason.clear();
            }
        }
    }

    /// A failure before any version could be tried (config, storage): versions already serving
    /// keep serving and carry the reason.
    pub fn fail_model(&self, name: &str, reason: &str) {
        let mut models = self.write();
        let entry = models.entry(name.to_string()).or_default();
        entry.unloaded = false;
        if entry.versions.values().any(|s| s.serving.is_some()) {
            for s in entry.versions.values_mut() {
                s.reason = format!("reload failed, still serving the previous load: {reason}");
            }
        } else {
            entry.versions.retain(|_, s| s.state != Some(State::Loading));
            entry.reason = Some(reason.to_string());
        }
    }

    /// Installs the outcome of a load in one step. Versions that loaded replace what served
    /// before; versions that failed leave an old copy serving when there is one; versions
    /// outside the new set leave service, unless some new version failed: then they keep
    /// serving until a load succeeds whole. Returns the versions to retire.
    pub fn install(&self, name: &str, outcomes: BTreeMap<u64, VersionOutcome>) -> Vec<Arc<ModelVersion>> {
        let mut models = self.write();
        let entry = models.entry(name.to_string()).or_default();
        entry.reason = None;
        entry.unloaded = false;
        let mut retired = Vec::new();
        let failed: Vec<String> =
            outcomes.iter().filter_map(|(v, o)| o.as_ref().err().map(|e| format!("version {v}: {e}"))).collect();
        let old: Vec<u64> = entry.versions.keys().copied().collect();
        for v in old.into_iter().filter(|v| !outcomes.contains_key(v)) {
            if failed.is_empty() {
                if let Some(slot) = entry.versions.remove(&v) {
                    retired.extend(slot.serving);
                }
            } else if let Some(slot) = entry.versions.get_mut(&v) {
                if slot.serving.is_some() {
                    slot.reason = format!("kept serving: its replacement failed to load ({})", failed.join("; "));
                } else {
                    entry.versions.remove(&v);
                }
            }
        }
        for (v, outcome) in outcomes {
            let slot = entry.versions.entry(v).or_default();
            match outcome {
                Ok(new) => {
                    retired.extend(slot.serving.replace(new));
                    slot.state = Some(State::Ready);
                    slot.reason.clear();
                }
                Err(reason) if slot.serving.is_some() => {
                    slot.state = Some(State::Ready);
                    slot.reason = format!("reload failed, still serving the previous load: {reason}");
                }
                Err(reason) => {
                    slot.state = Some(State::Unavailable);
                    slot.reason = reason;
                }
            }
        }
        retired
    }

    /// Takes every version out of service; returns them to retire.
    pub fn unload(&self, name: &str) -> Vec<Arc<ModelVersion>> {
        let mut models = self.write();
        let Some(entry) = models.get_mut(name) else {
            return Vec::new();
        };
        entry.unloaded = true;
        entry.reason = None;
        entry
            .versions
            .values_mut()
            .filter_map(|s| {
                s.state = Some(State::Unavailable);
                s.reason = "unloaded".into();
                s.serving.take()
            })
            .collect()
    }

    /// Whether strict readiness waits for this model now.
    pub fn counts_for_readiness(&self, name: &str) -> bool {
        self.read().get(name).is_some_and(|e| !e.unloaded)
    }

    /// A model none of whose versions serve is left out of strict readiness (a failed load
    /// through the repository API: the server was not asked to serve it until a load succeeds).
    pub fn excuse_if_not_serving(&self, name: &str) {
        if let Some(e) = self.write().get_mut(name)
            && !e.versions.values().any(|s| s.serving.is_some())
        {
            e.unloaded = true;
        }
    }

    /// A model start-up is about to load: known (and waited for by strict readiness) before its
    /// files are even staged.
    pub fn expect(&self, name: &str) {
        self.write().entry(name.to_string()).or_default().unloaded = false;
    }

    /// Records a model name that exists in a repository but is not loaded.
    pub fn know(&self, name: &str) {
        self.write().entry(name.to_string()).or_insert_with(|| Entry { unloaded: true, ..Default::default() });
    }
}

impl crate::ensemble::Models for Registry {
    fn schema(
        &self,
        namespace: Option<usize>,
        name: &str,
        version: Option<u64>,
    ) -> std::result::Result<Arc<crate::schema::Schema>, String> {
        self.resolve_in(namespace, name, version)
            .map(|m| Arc::clone(&m.schema))
            .map_err(|e| format!("the composing model is not ready ({}); load it before the ensemble", e.message()))
    }
}
