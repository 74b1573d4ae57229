//! Start-up loading: every model the control mode asks for is staged first (downloads run in
//! parallel), then plain models load (in parallel), then ensembles in dependency order, so an
//! ensemble always finds its composing models loaded. In explicit mode, an ensemble named with
//! `--load-model` brings its composing models along.
use std::{collections::BTreeMap, path::PathBuf, sync::Arc};

use super::{
    config,
    control::{ControlMode, ModelRepository, say_held},
};

impl ModelRepository {
    /// Loads what the control mode says to load at start-up; returns a line per failure.
    pub async fn load_startup(self: &Arc<Self>, load_models: &[String]) -> Vec<String> {
        let (found, duplicates) = match self.sources.scan().await {
            Ok(f) => f,
            Err(e) => return vec![e],
        };
        let mut failures: Vec<String> = Vec::new();
        let everything = self.mode != ControlMode::Explicit || load_models.iter().any(|m| m == "*");
        let mut wanted: Vec<String> = if everything {
            for (name, reason) in duplicates {
                tracing::error!(model = %name, error = %reason, "model not loaded");
                self.loader.registry().fail_model(&name, &reason);
                failures.push(reason);
            }
            found.iter().map(|f| f.key.clone()).collect()
        } else {
            let named = |f: &super::sources::Found, m: &String| &f.name == m || &f.key == m;
            for name in load_models.iter().filter(|m| !found.iter().any(|f| named(f, m))) {
                failures.push(format!("--load-model={name}: no model folder named '{name}' in the model repositories"));
            }
            found.iter().filter(|f| load_models.iter().any(|m| named(f, m))).map(|f| f.key.clone()).collect()
        };
        for name in &wanted {
            self.loader.registry().expect(name);
        }
        // Stage, then add composing models nobody asked for, until nothing is missing.
        let mut staged: BTreeMap<String, PathBuf> = BTreeMap::new();
        let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
        while !wanted.is_empty() {
            let batch: Vec<_> = found.iter().filter(|f| wanted.contains(&f.key)).cloned().collect();
            wanted.clear();
            for (name, outcome) in self.stage_all(batch).await {
                match outcome {
                    Ok(dir) => {
                        let steps = config::ensemble_steps(&dir, None)
                            .iter()
                            .map(|s| self.step_key(&found, &name, s))
                            .collect();
                        let steps: Vec<String> = match steps {
                            Ok(s) => s,
                            Err(e) => {
                                self.loader.registry().fail_model(&name, e.message());
                                failures.push(e.to_string());
                                continue;
                            }
                        };
                        for d in &steps {
                            if !staged.contains_key(d) && d != &name && found.iter().any(|f| &f.key == d) {
                                self.loader.registry().expect(d);
                                wanted.push(d.clone());
                            }
                        }
                        deps.insert(name.clone(), steps);
                        staged.insert(name, dir);
                    }
                    Err(e) => failures.push(e),
                }
            }
            wanted.retain(|n| !staged.contains_key(n));
            wanted.sort();
            wanted.dedup();
        }
        // Plain models first (all at once), then ensembles whose composing models were tried.
        let mut tried: Vec<String> = Vec::new();
        let mut left: Vec<String> = staged.keys().cloned().collect();
        while !left.is_empty() {
            let (now, later): (Vec<String>, Vec<String>) = left
                .into_iter()
                .partition(|n| deps[n].iter().all(|d| tried.contains(d) || !staged.contains_key(d) || d == n));
            if now.is_empty() {
                for n in &later {
                    let reason = format!("ensemble '{n}' is part of a cycle of ensembles ({later:?})");
                    self.loader.registry().fail_model(n, &reason);
                    failures.push(reason);
                }
                break;
            }
            let batch = found.iter().filter(|f| now.contains(&f.key)).map(|f| (f.clone(), staged[&f.key].clone()));
            failures.extend(self.load_all(batch.collect()).await);
            tried.extend(now);
            left = later;
        }
        failures
    }

    /// Plans and stages models, four at a time. A JoinSet: when start-up is abandoned (a stop
    /// signal), dropping it cancels the downloads in progress.
    async fn stage_all(self: &Arc<Self>, models: Vec<super::sources::Found>) -> Vec<(String, Result<PathBuf, String>)> {
        let limit = Arc::new(tokio::sync::Semaphore::new(4));
        let mut tasks = tokio::task::JoinSet::new();
        for f in models {
            let (repo, limit) = (Arc::clone(self), Arc::clone(&limit));
            tasks.spawn(async move {
                let _permit = limit.acquire().await;
                let plan = repo.sources.plan(&f, None).await;
                say_held(&f.name, &plan);
                repo.remember(&f, &plan).await;
                let staged = repo.stage(&f, &plan).await.map_err(|e| e.to_string());
                (f.key, staged)
            });
        }
        let mut out = Vec::new();
        while let Some(task) = tasks.join_next().await {
            match task {
                Ok(r) => out.push(r),
                Err(e) => out.push((String::new(), Err(format!("a model staging task failed: {e}")))),
            }
        }
        out
    }

    /// Loads staged models, four at a time; returns a line per failure.
    async fn load_all(self: &Arc<Self>, models: Vec<(super::sources::Found, PathBuf)>) -> Vec<String> {
        let limit = Arc::new(tokio::sync::Semaphore::new(4));
        let mut tasks = tokio::task::JoinSet::new();
        for (found, dir) in models {
            let (repo, limit) = (Arc::clone(self), Arc::clone(&limit));
            tasks.spawn(async move {
                let _permit = limit.acquire().await;
                let lock = repo.lock_for(&found.key);
                let _guard = lock.lock().await;
                repo.load_staged(&found, &dir, None).await
            });
        }
        let mut failures = Vec::new();
        while let Some(task) = tasks.join_next().await {
            match task {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failures.push(e.to_string()),
                Err(e) => failures.push(format!("a model load task failed: {e}")),
            }
        }
        failures
    }
}
