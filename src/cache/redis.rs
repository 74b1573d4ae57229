//! The shared tier: a Redis server every replica reaches. It is an optimisation only: a lookup or
//! store that fails or outlasts its timeout counts as a miss, is counted in the metrics, is
//! logged (at most every 10 s), and Redis is left alone for a second before it is tried again.
use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use arc_swap::ArcSwapOption;
use redis::aio::MultiplexedConnection;

use super::{Cached, Key, codec};
use crate::names::percent_encode;

/// `--cache-config redis,<key>=<value>` settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisSettings {
    pub host: String,
    pub port: u16,
    pub user: Option<String>,
    pub password: Option<String>,
    pub db: i64,
    pub tls: bool,
    /// Put before every key, so several deployments can share one server.
    pub prefix: String,
    /// Seconds an entry lives; 0 = until Redis evicts it.
    pub ttl_secs: u64,
    pub connect_timeout: Duration,
    /// Longest wait for one lookup or store.
    pub timeout: Duration,
}

impl Default for RedisSettings {
    fn default() -> Self {
        RedisSettings {
            host: String::new(),
            port: 6379,
            user: None,
            password: None,
            db: 0,
            tls: false,
            prefix: "ferry:".into(),
            ttl_secs: 0,
            connect_timeout: Duration::from_millis(500),
            timeout: Duration::from_millis(100),
        }
    }
}

impl RedisSettings {
    /// The connection URL (user and password escaped).
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let auth = match (&self.user, &self.password) {
            (Some(u), Some(p)) => format!("{}:{}@", percent_encode(u), percent_encode(p)),
            (None, Some(p)) => format!(":{}@", percent_encode(p)),
            (Some(u), None) => format!("{}@", percent_encode(u)),
            (None, None) => String::new(),
        };
        let host = if self.host.contains(':') { format!("[{}]", self.host) } else { self.host.clone() };
        format!("{scheme}://{auth}{host}:{}/{}", self.port, self.db)
    }
}

/// How long Redis is left alone after a failure.
const REST: Duration = Duration::from_secs(1);
const WARN_EVERY: Duration = Duration::from_secs(10);

pub struct RedisTier {
    client: redis::Client,
    settings: RedisSettings,
    conn: ArcSwapOption<MultiplexedConnection>,
    connecting: tokio::sync::Mutex<()>,
    resting_until: Mutex<Option<Instant>>,
    last_warning: Mutex<Option<Instant>>,
    hits: AtomicU64,
    errors: AtomicU64,
}

impl RedisTier {
    pub fn new(settings: &RedisSettings) -> Result<Arc<Self>, String> {
        let client = redis::Client::open(settings.url())
            .map_err(|e| format!("--cache-config redis: cannot use {}:{}: {e}", settings.host, settings.port))?;
        let tier = Arc::new(RedisTier {
            client,
            settings: settings.clone(),
            conn: ArcSwapOption::empty(),
            connecting: tokio::sync::Mutex::new(()),
            resting_until: Mutex::new(None),
            last_warning: Mutex::new(None),
            hits: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let t = Arc::clone(&tier);
            rt.spawn(async move {
                if t.connection().await.is_some() {
                    tracing::info!(server = %t.describe(), "response cache: connected to Redis");
                }
            });
        }
        Ok(tier)
    }

    pub fn describe(&self) -> String {
        let s = &self.settings;
        format!("{}:{} db {} prefix '{}'{}", s.host, s.port, s.db, s.prefix, if s.tls { " (TLS)" } else { "" })
    }

    /// (hits, errors)
    pub fn counts(&self) -> (u64, u64) {
        (self.hits.load(Ordering::Relaxed), self.errors.load(Ordering::Relaxed))
    }

    fn redis_key(&self, key: &Key) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.settings.prefix.len() + 64);
        k.extend_from_slice(self.settings.prefix.as_bytes());
        for b in key {
            k.extend_from_slice(format!("{b:02x}").as_bytes());
        }
        k
    }

    fn resting(&self) -> bool {
        self.resting_until.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| Instant::now() < t)
    }

    /// The open connection, or a new one unless Redis is resting after a failure. One request
    /// connects; the others wait for it (at most the connect timeout).
    async fn connection(&self) -> Option<MultiplexedConnection> {
        if let Some(c) = self.conn.load_full() {
            return Some((*c).clone());
        }
        if self.resting() {
            return None;
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = self.conn.load_full() {
            return Some((*c).clone());
        }
        if self.resting() {
            return None;
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.settings.connect_timeout))
            .set_response_timeout(Some(self.settings.timeout));
        let attempt = self.client.get_multiplexed_async_connection_with_config(&config);
        match tokio::time::timeout(self.settings.connect_timeout, attempt).await {
            Ok(Ok(c)) => {
                self.conn.store(Some(Arc::new(c.clone())));
                Some(c)
            }
            Ok(Err(e)) => {
                self.failed("connection", &e.to_string());
                None
            }
            Err(_) => {
                self.failed("connection", &format!("no answer within {:?}", self.settings.connect_timeout));
                None
            }
        }
    }

    fn failed(&self, what: &str, error: &str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.conn.store(None);
        *self.resting_until.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + REST);
        let now = Instant::now();
        let mut last = self.last_warning.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|t| now.duration_since(t) >= WARN_EVERY) {
            *last = Some(now);
            tracing::warn!(
                server = %self.describe(), error,
                "response cache: Redis {what} failed; requests are served from the model (errors so far: {})",
                self.errors.load(Ordering::Relaxed)
            );
        }
    }

    /// The stored response, when Redis has one and answers in time.
    pub async fn get(&self, key: &Key) -> Option<Cached> {
        let mut conn = self.connection().await?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.redis_key(key));
        let found =
            match tokio::time::timeout(self.settings.timeout, cmd.query_async::<Option<Vec<u8>>>(&mut conn)).await {
                Ok(Ok(v)) => v?,
                Ok(Err(e)) => {
                    self.failed("lookup", &e.to_string());
                    return None;
                }
                Err(_) => {
                    self.failed("lookup", &format!("no answer within {:?}", self.settings.timeout));
                    return None;
                }
            };
        match codec::decode(found.into()) {
            Some(c) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(c)
            }
            None => {
                // One bad entry is a miss for that key only (the miss stores a good one over it):
                // Redis itself answered fine, so the shared tier stays on for everyone.
                self.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(server = %self.describe(), "response cache: a Redis entry does not decode; treated as a miss");
                None
            }
        }
    }

    /// Stores in the background: the request that produced the response does not wait.
    pub fn put(self: &Arc<Self>, key: &Key, value: &Cached) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let tier = Arc::clone(self);
        let k = self.redis_key(key);
        let v = codec::encode(value);
        rt.spawn(async move {
            let Some(mut conn) = tier.connection().await else { return };
            let mut cmd = redis::cmd("SET");
            cmd.arg(k).arg(v);
            if tier.settings.ttl_secs > 0 {
                cmd.arg("EX").arg(tier.settings.ttl_secs);
            }
            match tokio::time::timeout(tier.settings.timeout, cmd.query_async::<()>(&mut conn)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tier.failed("store", &e.to_string()),
                Err(_) => tier.failed("store", &format!("no answer within {:?}", tier.settings.timeout)),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_escape_credentials() {
        let s = RedisSettings {
            host: "cache.internal".into(),
            password: Some("p@ss:w/rd".into()),
            user: Some("ferry".into()),
            db: 2,
            tls: true,
            ..Default::default()
        };
        assert_eq!(s.url(), "rediss://ferry:p%40ss%3Aw%2Frd@cache.internal:6379/2");
        let plain = RedisSettings { host: "::1".into(), port: 7000, ..Default::default() };
        assert_eq!(plain.url(), "redis://[::1]:7000/0");
    }

    #[tokio::test]
    async fn a_dead_server_is_a_miss_and_an_error_count() {
        // Port 1 on loopback refuses connections.
        let tier = RedisTier::new(&RedisSettings { host: "127.0.0.1".into(), port: 1, ..Default::default() }).unwrap();
        assert!(tier.get(&[7; 32]).await.is_none());
        assert!(tier.counts().1 >= 1);
        // Resting: the next lookup does not even try.
        let before = tier.counts().1;
        assert!(tier.get(&[7; 32]).await.is_none());
        assert_eq!(tier.counts().1, before);
    }
}
