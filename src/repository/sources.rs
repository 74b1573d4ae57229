//! Where model folders come from: local folders, or object-storage prefixes copied to a local
//! cache first. A remote model is loaded only from a complete, verified staging copy: objects are
//! cached by (store, path, tag, size) and reused across restarts on the same disk; a model's
//! staging folder is assembled from them under a temporary name and renamed into place whole.
//! Which version folders are complete is `complete`'s rule.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Instant,
};

use futures_util::{StreamExt, TryStreamExt, stream};

use super::{
    Found as LocalFound,
    complete::{self, Digest, MANIFEST, Manifest},
    scan as scan_local,
    storage::{Object, Progress, Remote, StorageSettings, md5_file, md5_hex, sha256_file},
};

pub enum Root {
    Local(PathBuf),
    /// Opened (credentials found) on first use, so that the server listens first.
    Remote(String, Box<tokio::sync::OnceCell<Remote>>),
}

impl Root {
    pub fn describe(&self) -> String {
        match self {
            Root::Local(p) => p.display().to_string(),
            Root::Remote(url, _) => url.trim_end_matches('/').to_string(),
        }
    }
}

/// Where one model's files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    Local(PathBuf),
    /// Objects relative to the remote root (`<model>/...`), with the root's index.
    Remote(usize, Vec<Object>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub name: String,
    /// What the registry, the locks and poll mode know the model by: its name, or with model
    /// namespacing its name qualified by its repository (`registry::qualified`).
    pub key: String,
    pub place: Place,
}

impl Found {
    /// Changes when anything of the model changes (names, sizes, times or tags). A local folder
    /// is walked on a blocking thread: a folder of 200,000 files must not stall the runtime
    /// (health checks, requests) for the time the walk takes.
    pub async fn fingerprint(&self) -> String {
        match &self.place {
            Place::Local(dir) => {
                let dir = dir.clone();
                let walked = tokio::task::spawn_blocking(move || {
                    let mut entries = Vec::new();
                    walk(&dir, &dir, &mut entries);
                    entries.sort();
                    md5_hex(&entries.join("\n"))
                });
                walked.await.unwrap_or_default()
            }
            Place::Remote(_, objects) => md5_hex(
                &objects.iter().map(|o| format!("{}:{}:{}", o.rel, o.size, o.tag)).collect::<Vec<_>>().join("\n"),
            ),
        }
    }
}

/// Every entry under `dir` with its size and time. Symbolic links are listed, not followed into
/// (a link to a folder above would loop forever), and nesting stops at 32 levels.
fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
    walk_at(root, dir, out, 0);
}

fn walk_at(root: &Path, dir: &Path, out: &mut Vec<String>, depth: usize) {
    if depth > 32 {
        return;
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        let meta = e.metadata().ok();
        let modified = meta
            .as_ref()
            .and_then(|m| m.modified().ok())
            .map_or(0, |t| t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        let rel = p.strip_prefix(root).map_or_else(|_| p.display().to_string(), |r| r.display().to_string());
        out.push(format!("{rel}:{}:{modified}", meta.map_or(0, |m| m.len())));
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            walk_at(root, &p, out, depth + 1);
        }
    }
}

fn sweep(models: &Path, objects: &Path, keep: &Path, model: &str) {
    use std::os::unix::fs::MetadataExt;
    for e in std::fs::read_dir(models).into_iter().flatten().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        let stale_partial = name
            .rsplit_once(".partial-")
            .is_some_and(|(_, pid)| pid != std::process::id().to_string() && !Path::new("/proc").join(pid).exists());
        // Another copy of the same model: its folder, staged from the same repository (with
        // namespacing, a model of that name in another repository is another model).
        let older = !name.contains(".partial")
            && p != keep
            && p.join(model).is_dir()
            && std::fs::read(p.join(SOURCE)).ok() == std::fs::read(keep.join(SOURCE)).ok();
        if stale_partial || older {
            let _ = std::fs::remove_dir_all(&p);
        }
    }
    let mut freed = 0u64;
    for e in std::fs::read_dir(objects).into_iter().flatten().flatten() {
        if let Ok(meta) = e.metadata()
            && meta.is_file()
            && meta.nlink() == 1
            && std::fs::remove_file(e.path()).is_ok()
        {
            freed += meta.len();
        }
    }
    if freed > 0 {
        tracing::debug!(bytes = freed, "model cache: removed files no model uses");
    }
}

/// The file beside a staged model folder that names the repository it came from.
const SOURCE: &str = ".source";

/// Builds a staging copy under a temporary name, then renames it into place whole.
fn assemble(
    partial: &Path,
    dir: &Path,
    links: &[(PathBuf, String)],
    (model, source): (&str, &str),
) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(partial);
    std::fs::create_dir_all(partial).map_err(|e| format!("cannot create the staging folder: {e}"))?;
    std::fs::write(partial.join(SOURCE), source).map_err(|e| format!("cannot create the staging folder: {e}"))?;
    for (from, rel) in links {
        let target = partial.join(rel);
        std::fs::create_dir_all(target.parent().unwrap_or(partial)).map_err(|e| e.to_string())?;
        if std::fs::hard_link(from, &target).is_err() {
            std::fs::copy(from, &target).map_err(|e| format!("cannot stage '{rel}': {e}"))?;
        }
    }
    std::fs::rename(partial, dir).map_err(|e| format!("cannot move the staging copy of '{model}' into place: {e}"))
}

pub struct Sources {
    roots: Vec<Root>,
    cache: PathBuf,
    settings: StorageSettings,
    progress: Arc<Progress>,
    /// The last listing of each remote root, for the names the index shows, and when it was made.
    listings: Mutex<HashMap<usize, Vec<Object>>>,
    listed_at: Mutex<Option<Instant>>,
    /// One index refresh at a time (the others wait and use its listing).
    refreshing: tokio::sync::Mutex<()>,
    manifest_cache: Mutex<HashMap<String, Result<Manifest, String>>>,
    /// Downloads running now.
    downloading: AtomicUsize,
    /// Staging holds it shared; cache clean-up alone.
    gc: tokio::sync::RwLock<()>,
    /// `--model-namespacing`: each root is a namespace, a name may be in several.
    namespacing: bool,
}

/// What a load would load, decided before anything is downloaded.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Changes whenever what would be loaded changes.
    pub key: String,
    /// Why some versions wait.
    pub held: Vec<String>,
    /// Usable version folders.
    pub versions: usize,
    source: PlanSource,
}

impl Plan {
    fn failed(reason: String) -> Plan {
        Plan { key: String::new(), held: Vec::new(), versions: 0, source: PlanSource::Failed(reason) }
    }
}

#[derive(Debug, Clone)]
enum PlanSource {
    Failed(String),
    Local(PathBuf),
    Remote { root: usize, usable: Vec<Object>, checks: Vec<(String, Digest)> },
}

/// Checks staged files against their manifests' digests.
fn verify_digests(base: &Path, checks: &[(String, Digest)]) -> Result<(), String> {
    for (rel, digest) in checks {
        let file = base.join(rel);
        let (got, want, kind) = match digest {
            Digest::Md5(want) => (md5_file(&file)?, want, "MD5"),
            Digest::Sha256(want) => (sha256_file(&file)?, want, "SHA-256"),
        };
        if &got != want {
            return Err(format!("'{rel}' has {kind} {got}, its {MANIFEST} says {want}"));
        }
    }
    Ok(())
}

impl Sources {
    /// Checks local folders now; buckets are opened on first use.
    pub fn new(locations: &[String], settings: &StorageSettings, cache: &Path) -> Result<Sources, String> {
        let mut roots = Vec::new();
        for l in locations {
            if Remote::is_remote(l) {
                roots.push(Root::Remote(l.clone(), Box::default()));
            } else {
                let p = PathBuf::from(l.strip_prefix("file://").unwrap_or(l));
                if !p.is_dir() {
                    return Err(format!("model repository '{}' is not a readable folder", p.display()));
                }
                // Absolute, so that a model's files are found from any working folder (a
                // Python model's process runs in its own).
                roots.push(Root::Local(std::path::absolute(&p).unwrap_or(p)));
            }
        }
        Ok(Sources {
            roots,
            cache: cache.to_path_buf(),
            settings: settings.clone(),
            progress: Arc::default(),
            listings: Mutex::default(),
            listed_at: Mutex::default(),
            refreshing: tokio::sync::Mutex::new(()),
            manifest_cache: Mutex::default(),
            downloading: AtomicUsize::new(0),
            gc: tokio::sync::RwLock::new(()),
            namespacing: false,
        })
    }

    /// With model namespacing, each root is its own namespace: a name may be in several.
    pub fn with_namespacing(mut self, on: bool) -> Sources {
        self.namespacing = on;
        self
    }

    pub fn namespacing(&self) -> bool {
        self.namespacing
    }

    fn key(&self, root: usize, name: &str) -> String {
        if self.namespacing { super::registry::qualified(root, name) } else { name.to_string() }
    }

    fn local_roots(&self) -> Vec<(usize, PathBuf)> {
        let local = self.roots.iter().enumerate();
        local.filter_map(|(i, r)| if let Root::Local(p) = r { Some((i, p.clone())) } else { None }).collect()
    }

    pub fn describe(&self) -> Vec<String> {
        self.roots.iter().map(Root::describe).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// Every model folder, listing each remote root once. A name in two roots is an error for
    /// that name, unless namespacing is on.
    pub async fn scan(&self) -> Result<(Vec<Found>, Vec<(String, String)>), String> {
        let mut found: Vec<(Found, String)> = Vec::new();
        let (local, namespacing) = (self.local_roots(), self.namespacing);
        // Listing local roots reads the file system: on a blocking thread, as the walks are.
        let listed = tokio::task::spawn_blocking(move || scan_local(&local, namespacing)).await;
        let (local_found, mut duplicates) = listed.map_err(|e| format!("cannot list the local repositories: {e}"))?;
        for LocalFound { name, dir, root } in local_found {
            let at = dir.display().to_string();
            found.push((Found { key: self.key(root, &name), name, place: Place::Local(dir) }, at));
        }
        for (i, root) in self.roots.iter().enumerate() {
            let Root::Remote(..) = root else { continue };
            let remote = self.remote(i).await?;
            let objects = remote.list().await?;
            let mut by_model: HashMap<String, Vec<Object>> = HashMap::new();
            for o in &objects {
                if let Some((model, rest)) = o.rel.split_once('/')
                    && !rest.is_empty()
                {
                    // A key that cannot be a file inside a model folder is never staged.
                    if let Err(e) =
                        crate::names::check_model_name(model).and_then(|()| crate::names::relative_path(&o.rel))
                    {
                        tracing::warn!(repository = %remote.url(), error = %e, "skipping an object whose key is not a model file");
                        continue;
                    }
                    by_model.entry(model.to_string()).or_default().push(o.clone());
                }
            }
            self.listings.lock().unwrap_or_else(|p| p.into_inner()).insert(i, objects);
            *self.listed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            for (name, objects) in by_model {
                if self.namespacing && name.contains("::") {
                    tracing::warn!(repository = %remote.url(), model = %name, "skipping a model whose name holds '::' (with --model-namespacing it would read as another repository's model)");
                    continue;
                }
                found.push((
                    Found { key: self.key(i, &name), name: name.clone(), place: Place::Remote(i, objects) },
                    format!("{}/{name}", remote.url()),
                ));
            }
        }
        found.sort_by(|a, b| a.0.key.cmp(&b.0.key));
        if self.namespacing {
            return Ok((found.into_iter().map(|(f, _)| f).collect(), duplicates));
        }
        let mut out: Vec<Found> = Vec::new();
        for (f, at) in found {
            if duplicates.iter().any(|(n, _)| *n == f.name) {
                continue;
            }
            if let Some(pos) = out.iter().position(|o| o.name == f.name) {
                out.remove(pos);
                duplicates.push((f.name.clone(), format!("model '{}' is in two repositories, one at '{at}'", f.name)));
            } else {
                out.push(f);
            }
        }
        Ok((out, duplicates))
    }

    /// Lists the remote roots again for the repository index, unless the last listing (a
    /// poll's, a load's, or another index call's) is younger than `max_age`: however often
    /// clients ask, buckets are listed at most once per `max_age`.
    pub async fn refresh(&self, max_age: std::time::Duration) {
        if !self.roots.iter().any(|r| matches!(r, Root::Remote(..))) {
            return;
        }
        let _one = self.refreshing.lock().await;
        let fresh = self.listed_at.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| t.elapsed() < max_age);
        if !fresh && let Err(e) = self.scan().await {
            tracing::warn!(error = %e, "cannot list the model repositories");
        }
    }

    /// Names known without listing again: local folders now, remote ones from the last listing.
    pub fn names_now(&self) -> Vec<String> {
        let mut names: Vec<String> = scan_local(&self.local_roots(), true).0.into_iter().map(|f| f.name).collect();
        for objects in self.listings.lock().unwrap_or_else(|p| p.into_inner()).values() {
            names.extend(
                objects
                    .iter()
                    .filter_map(|o| o.rel.split_once('/').map(|(m, _)| m.to_string()))
                    .filter(|m| crate::names::check_model_name(m).is_ok()),
            );
        }
        names.sort();
        names.dedup();
        names
    }

    /// What loading the model now would load. `previous`: the model at the last poll.
    pub async fn plan(&self, found: &Found, previous: Option<&Found>) -> Plan {
        match &found.place {
            Place::Local(dir) => Plan {
                key: found.fingerprint().await,
                held: Vec::new(),
                versions: usize::from(!super::version_dirs(dir).is_empty()),
                source: PlanSource::Local(dir.clone()),
            },
            Place::Remote(i, objects) => {
                let remote = match self.remote(*i).await {
                    Ok(r) => r,
                    Err(e) => return Plan::failed(e),
                };
                let before =
                    previous.and_then(|p| if let Place::Remote(_, o) = &p.place { Some(o.as_slice()) } else { None });
                let manifests = self.manifests(remote, objects).await;
                let selection = complete::select(objects, before, &manifests);
                let key = md5_hex(
                    &selection
                        .usable
                        .iter()
                        .map(|o| format!("{}:{}:{}", o.rel, o.size, o.tag))
                        .collect::<Vec<_>>()
                        .join("\n"),
                );
                Plan {
                    key,
                    held: selection.held,
                    versions: selection.versions,
                    source: PlanSource::Remote { root: *i, usable: selection.usable, checks: selection.checks },
                }
            }
        }
    }

    async fn remote(&self, i: usize) -> Result<&Remote, String> {
        let Root::Remote(url, cell) = &self.roots[i] else { unreachable!("root {i} is a local folder") };
        cell.get_or_try_init(|| Remote::open(url, &self.settings)).await
    }

    /// The manifests of a model's version folders, read once per (object, tag).
    async fn manifests(&self, remote: &Remote, objects: &[Object]) -> HashMap<String, Result<Manifest, String>> {
        let mut out = HashMap::new();
        for o in objects.iter().filter(|o| o.rel.ends_with(&format!("/{MANIFEST}"))) {
            let Some(v) = complete::version_of(&o.rel) else { continue };
            let key = format!("{}/{}#{}", remote.url(), o.rel, o.tag);
            let cached = self.manifest_cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key).cloned();
            let parsed = match cached {
                Some(m) => m,
                None => {
                    let m = remote.read(&o.rel).await.and_then(|bytes| Manifest::parse(&bytes));
                    self.manifest_cache.lock().unwrap_or_else(|p| p.into_inner()).insert(key, m.clone());
                    m
                }
            };
            out.insert(v.to_string(), parsed);
        }
        out
    }

    /// The local folder to load a plan from: the model's own folder, or a verified staging copy.
    pub async fn fetch(&self, name: &str, plan: &Plan) -> Result<PathBuf, String> {
        match &plan.source {
            PlanSource::Failed(reason) => Err(reason.clone()),
            PlanSource::Local(dir) => Ok(dir.clone()),
            PlanSource::Remote { root, usable, checks } => {
                let remote = self.remote(*root).await?;
                let dir = self.stage(remote, name, usable).await?;
                let base = dir.parent().unwrap_or(&dir).to_path_buf();
                let checks = checks.clone();
                tokio::task::spawn_blocking(move || verify_digests(&base, &checks))
                    .await
                    .map_err(|e| format!("digest check failed: {e}"))??;
                Ok(dir)
            }
        }
    }

    async fn stage(&self, remote: &Remote, model: &str, objects: &[Object]) -> Result<PathBuf, String> {
        let _staging = self.gc.read().await;
        Ok(self.stage_locked(remote, model, objects).await?.join(model))
    }

    /// Once `dir` (a staging copy) serves `model`: removes the model's older staging copies,
    /// staging left half-done by processes that are gone, then cached objects no staging copy
    /// links to. Not before: a load that fails leaves the old copy serving (and a Python model's
    /// process restarts from its folder). Local folders are never touched.
    pub async fn collect_garbage(&self, model: &str, dir: &Path) {
        let models = self.cache.join("models");
        let Some(keep) = dir.parent().filter(|p| p.parent() == Some(models.as_path())) else { return };
        let _alone = self.gc.write().await;
        let (keep, objects, model) = (keep.to_path_buf(), self.cache.join("objects"), model.to_string());
        let _ = tokio::task::spawn_blocking(move || sweep(&models, &objects, &keep, &model)).await;
    }

    async fn stage_locked(&self, remote: &Remote, model: &str, objects: &[Object]) -> Result<PathBuf, String> {
        let store_dir = self.cache.join("objects");
        std::fs::create_dir_all(&store_dir)
            .map_err(|e| format!("cannot create the cache {}: {e}", store_dir.display()))?;
        let key = |o: &Object| md5_hex(&format!("{}/{}#{}#{}", remote.url(), o.rel, o.tag, o.size));
        let missing: Vec<&Object> = objects
            .iter()
            .filter(|o| std::fs::metadata(store_dir.join(key(o))).map_or(true, |m| m.len() != o.size))
            .collect();
        let bytes: u64 = missing.iter().map(|o| o.size).sum();
        if !missing.is_empty() {
            let started = Instant::now();
            if self.downloading.fetch_add(1, Ordering::SeqCst) == 0 {
                self.progress.done.store(0, Ordering::Relaxed);
                self.progress.total.store(0, Ordering::Relaxed);
            }
            self.progress.total.fetch_add(bytes, Ordering::Relaxed);
            tracing::info!(
                model,
                objects = missing.len(),
                bytes,
                cached = objects.len() - missing.len(),
                "downloading model files"
            );
            // Futures gathered first: a closure inside the stream's type would make the
            // spawned task's future not Send (rust-lang/rust#102211).
            let fetches: Vec<_> = missing
                .iter()
                .map(|o| {
                    let dest = store_dir.join(key(o));
                    async move { remote.fetch(o, &dest, &self.progress).await }
                })
                .collect();
            let download =
                stream::iter(fetches).buffer_unordered(self.settings.parallel.max(1)).try_collect::<Vec<()>>();
            tokio::pin!(download);
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
            tick.tick().await;
            let result = loop {
                tokio::select! {
                    r = &mut download => break r,
                    _ = tick.tick() => {
                        let (done, total) = (self.progress.done.load(Ordering::Relaxed), self.progress.total.load(Ordering::Relaxed));
                        tracing::info!(model, bytes_done = done, bytes_total = total, "downloading");
                    }
                }
            };
            self.downloading.fetch_sub(1, Ordering::SeqCst);
            result.map_err(|e| format!("download of model '{model}' failed: {e}"))?;
            let secs = started.elapsed().as_secs_f64();
            tracing::info!(
                model,
                bytes,
                seconds = secs,
                mib_per_s = bytes as f64 / 1048576.0 / secs.max(1e-6),
                "downloaded"
            );
        }
        let digest = md5_hex(&objects.iter().map(|o| format!("{}={}", o.rel, key(o))).collect::<Vec<_>>().join("\n"));
        let models_dir = self.cache.join("models");
        let dir = models_dir.join(&digest);
        if !dir.is_dir() {
            // Links (or copies) of whole model files: blocking work, off the async workers.
            let links: Vec<(PathBuf, String)> =
                objects.iter().map(|o| (store_dir.join(key(o)), o.rel.clone())).collect();
            let (partial, dir, model) =
                (models_dir.join(format!("{digest}.partial-{}", std::process::id())), dir.clone(), model.to_string());
            let source = remote.url().to_string();
            tokio::task::spawn_blocking(move || assemble(&partial, &dir, &links, (&model, &source)))
                .await
                .map_err(|e| format!("staging failed: {e}"))??;
        }
        Ok(dir)
    }

    /// Bytes fetched of those to fetch, while a download runs.
    pub fn progress(&self) -> Option<serde_json::Value> {
        if self.downloading.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let (done, total) = (self.progress.done.load(Ordering::Relaxed), self.progress.total.load(Ordering::Relaxed));
        Some(
            serde_json::json!({"bytes_done": done, "bytes_total": total, "detail": format!("downloading {done} of {total} bytes")}),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[tokio::test(flavor = "current_thread")]
    async fn a_local_folder_is_walked_off_the_runtime_thread() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..5000 {
            std::fs::write(dir.path().join(format!("f{i}")), b"x").unwrap();
        }
        let found =
            super::Found { name: "m".into(), key: "m".into(), place: super::Place::Local(dir.path().to_path_buf()) };
        let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = {
            let ticks = std::sync::Arc::clone(&ticks);
            tokio::spawn(async move {
                loop {
                    ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            })
        };
        tokio::task::yield_now().await;
        let before = ticks.load(std::sync::atomic::Ordering::Relaxed);
        let fingerprint = found.fingerprint().await;
        // The one runtime thread went on running other tasks while the folder was walked.
        assert!(ticks.load(std::sync::atomic::Ordering::Relaxed) > before + 1);
        counter.abort();
        assert_eq!(fingerprint, found.fingerprint().await, "the same folder, the same fingerprint");
    }

    #[test]
    fn the_sweep_keeps_what_serves_and_what_is_being_built() {
        let cache = tempfile::tempdir().unwrap();
        let (models, objects) = (cache.path().join("models"), cache.path().join("objects"));
        let dir = |p: &Path| std::fs::create_dir_all(p).unwrap();
        let (keep, older) = (models.join("keep"), models.join("older"));
        let (other_model, dead, building) = (
            models.join("other"),
            models.join("x.partial-999999999"),
            models.join(format!("y.partial-{}", std::process::id())),
        );
        for d in [keep.join("m/1"), older.join("m/1"), other_model.join("n/1"), dead.join("m"), building.join("m")] {
            dir(&d);
        }
        dir(&objects);
        std::fs::write(objects.join("used"), b"weights").unwrap();
        std::fs::hard_link(objects.join("used"), keep.join("m/1/model.onnx")).unwrap();
        std::fs::write(objects.join("unused"), b"old weights").unwrap();
        super::sweep(&models, &objects, &keep, "m");
        assert!(keep.join("m/1/model.onnx").is_file(), "the serving copy stays");
        assert!(!older.exists(), "the model's older copy goes");
        assert!(other_model.exists(), "another model's copy stays");
        assert!(!dead.exists(), "staging of a process that is gone goes");
        assert!(building.exists(), "this process's staging in progress stays");
        assert!(objects.join("used").exists() && !objects.join("unused").exists());
    }
}
