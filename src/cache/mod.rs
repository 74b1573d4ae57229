//! The response cache: repeated requests to models with `response_cache { enable: true }` are
//! answered before the scheduler, from a byte-bounded in-process LRU, then from a Redis tier
//! shared by every replica. Identical requests that arrive while one of them runs wait for it
//! (single flight) instead of running the model again. Only successful responses are stored, and
//! a fault of the shared tier only ever costs a miss.
use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::request::{InferRequest, InferResponse, Parameters};
use crate::tensor::Tensor;

pub mod codec;
mod local;
pub mod redis;
#[cfg(test)]
mod tests;

pub use redis::RedisSettings;

/// SHA-256 over everything that decides a response.
pub type Key = [u8; 32];

/// `--cache-config`: the tiers to run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheSettings {
    /// Bytes of the in-process tier; None = no local tier.
    pub local_bytes: Option<usize>,
    pub redis: Option<RedisSettings>,
}

/// The key of a request to `model` at its resolved `version` whose files and config have the
/// digest `content` (a version overwritten in place gets new keys, here and in a Redis tier
/// other replicas share): the inputs in name order, each with its datatype, shape and bytes,
/// then the requested outputs in request order (their order and classification change the
/// response). Lengths are hashed before contents, so no two different requests share an
/// encoding.
pub fn key(model: &str, version: u64, content: &str, req: &InferRequest) -> Key {
    fn field(h: &mut Sha256, b: &[u8]) {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    }
    let mut h = Sha256::new();
    field(&mut h, b"ferry-response-cache-v2");
    field(&mut h, model.as_bytes());
    h.update(version.to_le_bytes());
    field(&mut h, content.as_bytes());
    let mut inputs: Vec<_> = req.inputs.iter().collect();
    inputs.sort_by(|a, b| a.name.cmp(&b.name));
    h.update((inputs.len() as u64).to_le_bytes());
    for i in inputs {
        field(&mut h, i.name.as_bytes());
        field(&mut h, i.datatype.wire().as_bytes());
        h.update((i.shape.len() as u64).to_le_bytes());
        for d in &i.shape {
            h.update(d.to_le_bytes());
        }
        field(&mut h, &i.data);
    }
    h.update((req.outputs.len() as u64).to_le_bytes());
    for o in &req.outputs {
        field(&mut h, o.name.as_bytes());
        h.update(o.classification.map_or(u64::MAX, u64::from).to_le_bytes());
    }
    h.finalize().into()
}

/// What is kept of a successful response: everything but the names the request gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct Cached {
    pub parameters: Parameters,
    pub outputs: Vec<Tensor>,
}

impl Cached {
    /// The entry owns exactly the bytes it is charged for: an output is often a slice of its
    /// batch's buffer, which sharing would keep whole for as long as the entry lives.
    pub fn of(resp: &InferResponse) -> Self {
        let outputs =
            resp.outputs.iter().map(|t| Tensor { data: bytes::Bytes::copy_from_slice(&t.data), ..t.clone() }).collect();
        Cached { parameters: resp.parameters.clone(), outputs }
    }

    /// The response a miss would have produced for this request.
    pub fn response(&self, model: &str, version: u64, id: &str) -> InferResponse {
        InferResponse {
            model_name: model.to_string(),
            model_version: version,
            id: id.to_string(),
            parameters: self.parameters.clone(),
            outputs: self.outputs.clone(),
        }
    }

    /// Bytes charged against the local tier's bound.
    fn charge(&self) -> usize {
        const ENTRY: usize = 160;
        ENTRY
            + self.parameters.keys().map(|k| k.len() + 32).sum::<usize>()
            + self.outputs.iter().map(|t| 64 + t.name.len() + t.shape.len() * 8 + t.data.len()).sum::<usize>()
    }
}

type Slot = watch::Receiver<Option<Arc<Cached>>>;

/// Counters of the tiers, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheCounts {
    pub local_entries: u64,
    pub local_bytes: u64,
    pub local_capacity: u64,
    pub shared_hits: u64,
    pub shared_errors: u64,
    pub joined: u64,
}

pub struct ResponseCache {
    local: Option<Mutex<local::Lru>>,
    shared: Option<Arc<redis::RedisTier>>,
    /// Keys being computed, and where their result will appear.
    inflight: Mutex<HashMap<Key, Slot>>,
    joined: AtomicU64,
}

/// The outcome of a lookup.
pub enum Lookup {
    Hit(Arc<Cached>),
    /// The caller computes the response and hands it to the filler (dropping it unfilled lets
    /// the requests waiting on this key run on their own).
    Miss(Filler),
}

impl ResponseCache {
    /// Builds the tiers; the Redis connection opens in the background.
    pub fn new(settings: &CacheSettings) -> Result<Arc<Self>, String> {
        let shared = settings.redis.as_ref().map(redis::RedisTier::new).transpose()?;
        Ok(Arc::new(ResponseCache {
            local: settings.local_bytes.map(|b| Mutex::new(local::Lru::new(b))),
            shared,
            inflight: Mutex::default(),
            joined: AtomicU64::new(0),
        }))
    }

    fn local_get(&self, key: &Key) -> Option<Arc<Cached>> {
        self.local.as_ref()?.lock().unwrap_or_else(|p| p.into_inner()).get(key)
    }

    fn local_put(&self, key: Key, value: Arc<Cached>) {
        if let Some(l) = &self.local {
            let charge = value.charge();
            l.lock().unwrap_or_else(|p| p.into_inner()).put(key, value, charge);
        }
    }

    /// Local tier, then a computation of the same key already running, then the shared tier.
    pub async fn lookup(self: &Arc<Self>, key: Key) -> Lookup {
        loop {
            if let Some(hit) = self.local_get(&key) {
                return Lookup::Hit(hit);
            }
            let waiting = {
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(hit) = self.local_get(&key) {
                    return Lookup::Hit(hit);
                }
                match inflight.get(&key) {
                    Some(slot) => Err(slot.clone()),
                    None => {
                        let (tx, rx) = watch::channel(None);
                        inflight.insert(key, rx);
                        Ok(tx)
                    }
                }
            };
            match waiting {
                Err(mut slot) => {
                    // Closed without a value: that computation failed or was cancelled; try again.
                    if let Ok(v) = slot.wait_for(Option::is_some).await
                        && let Some(hit) = v.clone()
                    {
                        self.joined.fetch_add(1, Ordering::Relaxed);
                        return Lookup::Hit(hit);
                    }
                }
                Ok(tx) => {
                    let filler = Filler { cache: Arc::clone(self), key, tx: Some(tx) };
                    if let Some(shared) = &self.shared
                        && let Some(hit) = shared.get(&key).await
                    {
                        let hit = Arc::new(hit);
                        filler.publish(Arc::clone(&hit));
                        return Lookup::Hit(hit);
                    }
                    return Lookup::Miss(filler);
                }
            }
        }
    }

    /// (entries, bytes charged, the bound) of the local tier.
    fn local_usage(&self) -> Option<(usize, usize, usize)> {
        Some(self.local.as_ref()?.lock().unwrap_or_else(|p| p.into_inner()).usage())
    }

    pub fn counts(&self) -> CacheCounts {
        let (local_entries, local_bytes, local_capacity) = self.local_usage().unwrap_or_default();
        let (shared_hits, shared_errors) = self.shared.as_ref().map(|s| s.counts()).unwrap_or_default();
        CacheCounts {
            local_entries: local_entries as u64,
            local_bytes: local_bytes as u64,
            local_capacity: local_capacity as u64,
            shared_hits,
            shared_errors,
            joined: self.joined.load(Ordering::Relaxed),
        }
    }

    /// What the start-up log says.
    pub fn describe(&self) -> String {
        let mut tiers = Vec::new();
        if let Some((_, _, capacity)) = self.local_usage() {
            tiers.push(format!("local {capacity} bytes"));
        }
        if let Some(s) = &self.shared {
            tiers.push(format!("redis {}", s.describe()));
        }
        tiers.join(", then ")
    }
}

/// Completes a miss: the response is stored in every tier and handed to the waiting requests.
pub struct Filler {
    cache: Arc<ResponseCache>,
    key: Key,
    tx: Option<watch::Sender<Option<Arc<Cached>>>>,
}

impl Filler {
    pub fn fill(self, resp: &InferResponse) {
        let value = Arc::new(Cached::of(resp));
        if let Some(shared) = &self.cache.shared {
            shared.put(&self.key, &value);
        }
        self.publish(value);
    }

    fn publish(mut self, value: Arc<Cached>) {
        self.cache.local_put(self.key, Arc::clone(&value));
        self.release();
        if let Some(tx) = self.tx.take() {
            tx.send_replace(Some(value));
        }
    }

    fn release(&self) {
        self.cache.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}

impl Drop for Filler {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.release();
        }
    }
}
