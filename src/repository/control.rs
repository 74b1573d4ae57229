//! The model repository as the server runs it: start-up loading per control mode, poll mode,
//! and the repository extension (index, load with config and file overrides, unload).
use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::{Arc, Mutex},
};

use super::{
    loader::Loader,
    registry::{IndexEntry, State},
    sources::{Found, Place, Plan, Sources},
};
use crate::{
    error::{Error, Result},
    proto::pbtxt,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlMode {
    /// Load everything at start; no changes at run time.
    None,
    /// Load only `--load-model` models at start; the load/unload API decides the rest.
    Explicit,
    /// Load everything at start, then follow the repositories' changes.
    Poll,
}

/// A load through the repository API.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadRequest {
    /// A ModelConfig in Triton's JSON form that replaces config.pbtxt.
    pub config: Option<String>,
    /// Files of a model folder given inline: (path like `1/model.onnx`, content).
    pub files: Vec<(String, Vec<u8>)>,
}

/// What poll mode remembers of a model.
#[derive(Debug, Clone)]
struct Seen {
    /// The model at the last poll, and its fingerprint then.
    last: Found,
    fingerprint: String,
    /// The plan key of the last load (tried, whether or not it loaded).
    loaded: String,
    /// Why versions waited at the last poll (said again only when it changes).
    held: Vec<String>,
}

pub struct ModelRepository {
    pub(super) sources: Sources,
    pub(super) loader: Loader,
    pub(super) mode: ControlMode,
    /// How old a bucket listing may be when the index is asked for (the poll interval).
    listing_max_age: std::time::Duration,
    /// One load or unload at a time per model.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Folders written from load-request files, kept while their model may use them.
    inline: Mutex<HashMap<String, tempfile::TempDir>>,
    seen: Mutex<HashMap<String, Seen>>,
}

impl ModelRepository {
    pub fn new(sources: Sources, loader: Loader, mode: ControlMode, listing_max_age: std::time::Duration) -> Self {
        ModelRepository {
            sources,
            loader,
            mode,
            listing_max_age,
            locks: Mutex::default(),
            inline: Mutex::default(),
            seen: Mutex::default(),
        }
    }

    pub fn loader(&self) -> &Loader {
        &self.loader
    }

    pub(super) fn lock_for(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(name.to_string()).or_default())
    }

    /// The model folder of a name, or (namespacing on) of a registry key.
    async fn find(&self, name: &str) -> Result<Found> {
        let mut all = self.find_all(name).await?;
        match all.len() {
            1 => Ok(all.remove(0)),
            n => Err(Error::invalid(format!(
                "failed to load '{name}': There are {n} identifiers of model '{name}' in global map, model namespace must be provided to resolve ambiguity."
            ))),
        }
    }

    /// Every model folder of a name (several with namespacing on), or the one of a key.
    async fn find_all(&self, name: &str) -> Result<Vec<Found>> {
        let (found, duplicates) = self.sources.scan().await.map_err(|e| {
            tracing::error!(model = name, error = %e, "cannot list the model repositories");
            Error::unavailable(format!(
                "failed to load '{name}': the model repositories could not be listed (the server log has the details)"
            ))
        })?;
        if let Some((_, reason)) = duplicates.iter().find(|(n, _)| n == name) {
            return Err(Error::invalid(format!("failed to load '{name}': {reason}")));
        }
        let exact: Vec<Found> = found.iter().filter(|f| f.key == name).cloned().collect();
        let all = if exact.is_empty() { found.into_iter().filter(|f| f.name == name).collect() } else { exact };
        if all.is_empty() {
            return Err(Error::invalid(format!(
                "failed to load '{name}': no model folder named '{name}' in the model repositories ({})",
                self.sources.describe().join(", ")
            )));
        }
        Ok(all)
    }

    /// Downloads (when remote) and loads what a plan says; the versions serving now keep serving
    /// if anything fails. An ensemble's composing models that do not serve yet load first.
    async fn load_plan(&self, found: &Found, plan: &Plan) -> Result<()> {
        let dir = self.stage(found, plan).await?;
        self.load_dependencies(&found.key, &dir, None, &[]).await?;
        self.load_staged(found, &dir, None).await
    }

    /// Loads a staged folder; once it serves, older staging copies of the model go.
    pub(super) async fn load_staged(
        &self,
        found: &Found,
        dir: &Path,
        config: Option<crate::proto::inference::ModelConfig>,
    ) -> Result<()> {
        self.loader.load(&found.key, dir, config).await?;
        self.sources.collect_garbage(&found.name, dir).await;
        Ok(())
    }

    /// The local folder of a plan (downloaded when remote).
    pub(super) async fn stage(&self, found: &Found, plan: &Plan) -> Result<std::path::PathBuf> {
        let name = &found.name;
        self.sources.fetch(name, plan).await.map_err(|reason| {
            // The full reason names buckets, paths and the server's cloud identity: the log has
            // it; clients (and the index they read) get what happened, not where.
            tracing::error!(model = %found.key, error = %reason, "model files could not be staged");
            let shown = super::storage::public_reason(&reason);
            self.loader.registry().fail_model(&found.key, &shown);
            Error::unavailable(format!("failed to load '{name}': {shown}"))
        })
    }

    /// The model a step of ensemble `ensemble` (a registry key) runs, among the folders found:
    /// with namespacing, the ensemble's own repository's model of that name, else the one
    /// other repository's (as Triton links its steps).
    pub(super) fn step_key(&self, found: &[Found], ensemble: &str, step: &str) -> Result<String> {
        let registry = self.loader.registry();
        let Some(root) = registry.root_of(ensemble) else { return Ok(step.to_string()) };
        // A step that names a repository (`<i>::<name>`) means that model.
        if super::registry::split_qualified(step).is_some() {
            return Ok(step.to_string());
        }
        let own = super::registry::qualified(root, step);
        if found.iter().any(|f| f.key == own) {
            return Ok(own);
        }
        let named: Vec<&Found> = found.iter().filter(|f| f.name == step).collect();
        match named.as_slice() {
            [] => Ok(own),
            [one] => Ok(one.key.clone()),
            many => Err(Error::invalid(format!(
                "failed to load '{}': its step model '{step}': There are {} identifiers of model '{step}' in global map, model namespace must be provided to resolve ambiguity.",
                registry.name_of(ensemble),
                many.len()
            ))),
        }
    }

    /// Loads the composing models of the ensemble in `dir` that are not serving (explicit mode:
    /// loading an ensemble loads its parts). `chain`: the ensembles being loaded around this
    /// one, to refuse a cycle instead of waiting on it.
    fn load_dependencies<'a>(
        &'a self,
        name: &'a str,
        dir: &'a Path,
        config: Option<&'a crate::proto::inference::ModelConfig>,
        chain: &'a [String],
    ) -> futures_util::future::BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut steps = super::config::ensemble_steps(dir, config);
            let registry = self.loader.registry();
            if steps.is_empty() {
                return Ok(());
            }
            if self.sources.namespacing() {
                let (found, _) = self.sources.scan().await.unwrap_or_default();
                steps = steps.iter().map(|s| self.step_key(&found, name, s)).collect::<Result<_>>()?;
            }
            for dep in steps.into_iter().filter(|d| !registry.serves(d)) {
                if dep == name || chain.contains(&dep) {
                    let cycle: Vec<&str> = chain.iter().map(String::as_str).chain([name, &dep[..]]).collect();
                    return Err(Error::invalid(format!(
                        "failed to load '{name}': ensembles would call each other in a cycle: {}",
                        cycle.join(" -> ")
                    )));
                }
                tracing::info!(model = %dep, ensemble = name, "loading a composing model of the ensemble");
                let lock = self.lock_for(&dep);
                let Ok(_guard) = tokio::time::timeout(std::time::Duration::from_secs(600), lock.lock()).await else {
                    return Err(Error::unavailable(format!(
                        "failed to load '{name}': composing model '{dep}' is busy"
                    )));
                };
                if registry.serves(&dep) {
                    continue;
                }
                let found = self.find(&dep).await.map_err(|e| e.context(format!("ensemble '{name}'")))?;
                let plan = self.sources.plan(&found, None).await;
                let dep_dir = self.stage(&found, &plan).await?;
                let mut deeper = chain.to_vec();
                deeper.push(name.to_string());
                self.load_dependencies(&dep, &dep_dir, None, &deeper).await?;
                self.load_staged(&found, &dep_dir, None).await?;
            }
            Ok(())
        })
    }

    /// `fingerprint`: the found model's (a local model's is its plan's key, computed once).
    pub(super) async fn remember(&self, found: &Found, plan: &Plan) {
        let fingerprint = match found.place {
            Place::Local(_) => plan.key.clone(),
            Place::Remote(..) => found.fingerprint().await,
        };
        let seen = Seen { last: found.clone(), fingerprint, loaded: plan.key.clone(), held: plan.held.clone() };
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).insert(found.key.clone(), seen);
    }

    /// One poll: loads new models, reloads changed ones once their changes settle, unloads
    /// removed ones. A reload that fails leaves what served serving.
    pub async fn poll(&self) {
        let (found, duplicates) = match self.sources.scan().await {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "poll: cannot list the model repositories; nothing changes");
                return;
            }
        };
        for f in found.iter() {
            let before = self.seen.lock().unwrap_or_else(|p| p.into_inner()).get(&f.key).cloned();
            let plan = self.sources.plan(f, before.as_ref().map(|s| &s.last)).await;
            let fingerprint = match f.place {
                Place::Local(_) => plan.key.clone(),
                Place::Remote(..) => f.fingerprint().await,
            };
            // A local folder must stay as it is for one poll; remote versions settle by the
            // completeness rule inside the plan.
            let settled =
                matches!(f.place, Place::Remote(..)) || before.as_ref().is_none_or(|s| s.fingerprint == fingerprint);
            let unchanged = before.as_ref().is_some_and(|s| s.loaded == plan.key);
            if before.as_ref().is_none_or(|s| s.held != plan.held) {
                say_held(&f.name, &plan);
            }
            let loaded = if settled && !unchanged && plan.versions > 0 {
                let lock = self.lock_for(&f.key);
                let _guard = lock.lock().await;
                tracing::info!(model = %f.key, "poll: loading the model's new or changed files");
                if let Err(e) = self.load_plan(f, &plan).await {
                    tracing::error!(model = %f.key, error = %e, "poll: load failed; what served keeps serving");
                }
                plan.key
            } else {
                before.map(|s| s.loaded).unwrap_or_default()
            };
            let seen = Seen { last: f.clone(), fingerprint, loaded, held: plan.held };
            self.seen.lock().unwrap_or_else(|p| p.into_inner()).insert(f.key.clone(), seen);
        }
        let gone: Vec<String> = self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .filter(|n| !found.iter().any(|f| &f.key == *n) && !duplicates.iter().any(|(d, _)| d == *n))
            .cloned()
            .collect();
        for name in gone {
            tracing::info!(model = %name, "poll: the model left the repositories; unloading");
            let lock = self.lock_for(&name);
            let _guard = lock.lock().await;
            self.loader.unload(&name);
            self.seen.lock().unwrap_or_else(|p| p.into_inner()).remove(&name);
        }
    }

    fn check_explicit(&self) -> Result<()> {
        match self.mode {
            ControlMode::Explicit => Ok(()),
            ControlMode::None | ControlMode::Poll => Err(Error::unavailable(
                "explicit model load / unload is not allowed if polling is enabled (start ferry with --model-control-mode=explicit)",
            )),
        }
    }

    /// Every model folder of the repositories and every model ever loaded, with its versions'
    /// states; `ready_only` keeps the READY ones.
    pub fn index(&self, ready_only: bool) -> Vec<IndexEntry> {
        let mut entries: BTreeMap<String, Vec<IndexEntry>> = BTreeMap::new();
        for name in self.sources.names_now() {
            entries.entry(name).or_default();
        }
        for e in self.loader.registry().index() {
            entries.entry(e.name.clone()).or_default().push(e);
        }
        entries
            .into_iter()
            .flat_map(|(name, list)| {
                if list.is_empty() {
                    vec![IndexEntry { name, version: None, state: State::Unknown, reason: String::new() }]
                } else {
                    list
                }
            })
            .filter(|e| !ready_only || e.state == State::Ready)
            .collect()
    }

    /// Loads or reloads a model; the versions it replaces serve until the new ones are ready.
    /// A load that fails leaves strict readiness as it was: a model that did not serve before
    /// does not make the server unready.
    /// With namespacing, a name loads every repository's model of that name (Triton's way).
    pub async fn load(&self, name: &str, req: LoadRequest) -> Result<()> {
        self.check_explicit()?;
        check_name(name)?;
        if self.sources.namespacing() && req.files.is_empty() {
            for found in self.find_all(name).await? {
                self.load_one(&found.key, req.clone()).await?;
            }
            return Ok(());
        }
        self.load_one(name, req).await
    }

    async fn load_one(&self, name: &str, req: LoadRequest) -> Result<()> {
        let lock = self.lock_for(name);
        let _guard = lock.lock().await;
        let counted = self.loader.registry().counts_for_readiness(name);
        let result = self.load_locked(name, req).await;
        if result.is_err() && !counted {
            self.loader.registry().excuse_if_not_serving(name);
        }
        result
    }

    async fn load_locked(&self, name: &str, req: LoadRequest) -> Result<()> {
        let config = match &req.config {
            Some(json) => {
                Some(pbtxt::from_json(json).map_err(|e| Error::invalid(format!("Invalid config override: {e}")))?)
            }
            None => None,
        };
        if req.files.is_empty() {
            let found = self.find(name).await?;
            let plan = self.sources.plan(&found, None).await;
            say_held(&found.name, &plan);
            if config.is_none() {
                return self.load_plan(&found, &plan).await;
            }
            let dir = self.stage(&found, &plan).await?;
            self.load_dependencies(&found.key, &dir, config.as_ref(), &[]).await?;
            return self.load_staged(&found, &dir, config).await;
        }
        if config.is_none() {
            return Err(Error::invalid(format!(
                "failed to load '{name}': file overrides need a 'config' parameter too"
            )));
        }
        let temp = write_inline(name, &req.files)?;
        let dir = temp.path().join(name);
        self.load_dependencies(name, &dir, config.as_ref(), &[]).await?;
        self.loader.load(name, &dir, config).await?;
        self.inline.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), temp);
        Ok(())
    }

    /// Loads a model from a folder outside the repositories (SageMaker's multi-model API, which
    /// is its own control channel whatever the control mode).
    pub async fn load_dir(&self, name: &str, dir: &Path) -> Result<()> {
        check_name(name)?;
        let lock = self.lock_for(name);
        let _guard = lock.lock().await;
        self.loader.load_as(name, dir, None, true).await
    }

    /// Download progress of remote repositories (bytes done and total), while there is some.
    pub fn progress(&self) -> Option<serde_json::Value> {
        self.sources.progress()
    }

    /// `index` after listing the remote repositories again, when the last listing is older than
    /// the poll interval.
    pub async fn index_fresh(&self, ready_only: bool) -> Vec<IndexEntry> {
        self.sources.refresh(self.listing_max_age).await;
        self.index(ready_only)
    }

    /// Takes a model out of service; requests it admitted still finish.
    pub async fn unload(&self, name: &str, unload_dependents: bool) -> Result<()> {
        self.check_explicit()?;
        check_name(name)?;
        self.unload_any(name, unload_dependents).await
    }

    /// Unloads whatever the control mode (the SageMaker multi-model API).
    /// With namespacing, a name unloads every repository's model of that name.
    pub async fn unload_any(&self, name: &str, _unload_dependents: bool) -> Result<()> {
        for key in self.loader.registry().keys_named(name) {
            let lock = self.lock_for(&key);
            let _guard = lock.lock().await;
            self.loader.unload(&key);
            self.inline.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        }
        Ok(())
    }
}

/// A model name from a client, before anything is looked up or written under it.
fn check_name(name: &str) -> Result<()> {
    crate::names::check_model_name(name).map_err(Error::invalid)
}

pub(super) fn say_held(model: &str, plan: &Plan) {
    for why in &plan.held {
        tracing::info!(model, "{why}");
    }
}

/// Writes load-request files into a fresh folder `<temp>/<name>/`; every path must stay inside.
/// A path may start with one `/` (`file:/1/model.py`, as Triton's own clients send it): it is
/// relative to the model folder all the same.
fn write_inline(name: &str, files: &[(String, Vec<u8>)]) -> Result<tempfile::TempDir> {
    let temp = tempfile::Builder::new()
        .prefix("ferry-load-")
        .tempdir()
        .map_err(|e| Error::internal(format!("cannot create a folder for the model files: {e}")))?;
    let dir = temp.path().join(name);
    for (rel, content) in files {
        let path = crate::names::relative_path(rel.strip_prefix('/').unwrap_or(rel))
            .map_err(|e| Error::invalid(format!("failed to load '{name}': file override 'file:{rel}': {e}")))?;
        let target = dir.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::internal(format!("cannot write 'file:{rel}': {e}")))?;
        }
        std::fs::write(&target, content).map_err(|e| Error::internal(format!("cannot write 'file:{rel}': {e}")))?;
    }
    Ok(temp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_files_stay_inside_the_model_folder() {
        let ok = write_inline("m", &[("1/model.onnx".into(), vec![1, 2])]).unwrap();
        assert_eq!(std::fs::read(ok.path().join("m/1/model.onnx")).unwrap(), vec![1, 2]);
        for bad in ["../x", "//etc/passwd", "/../x", "1/../../x", "", "/"] {
            let e = write_inline("m", &[(bad.into(), vec![])]).unwrap_err();
            assert!(e.message().contains("file override"), "{bad}: {e}");
        }
        // One leading slash: still inside the model folder.
        let slash = write_inline("m", &[("/1/model.py".into(), vec![3])]).unwrap();
        assert_eq!(std::fs::read(slash.path().join("m/1/model.py")).unwrap(), vec![3]);
    }
}
