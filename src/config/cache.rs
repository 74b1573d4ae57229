//! `--cache-config` and `--response-cache-byte-size`, as tritonserver spells them.
use std::time::Duration;

use clap::Args;

use crate::cache::{CacheSettings, RedisSettings};

#[derive(Args, Debug, Clone)]
pub(super) struct CacheArgs {
    /// `local,size=<bytes>` and/or `redis,<key>=<value>` (repeatable; redis keys: host, port,
    /// user, password, db, tls_enabled, prefix, ttl, connect_timeout, socket_timeout).
    #[arg(long, env = "FERRY_CACHE_CONFIG", value_delimiter = ';')]
    cache_config: Vec<String>,
    /// Legacy form of `--cache-config local,size=<bytes>`.
    #[arg(long, env = "FERRY_RESPONSE_CACHE_BYTE_SIZE")]
    response_cache_byte_size: Option<usize>,
}

/// The smallest local cache that holds anything useful.
const MIN_LOCAL: usize = 1024;

impl CacheArgs {
    /// None: no cache configured (models' `response_cache` settings then do nothing).
    pub(super) fn resolve(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<CacheSettings>, String> {
        let mut settings = CacheSettings::default();
        let mut redis: Option<RedisSettings> = None;
        if let Some(size) = self.response_cache_byte_size {
            settings.local_bytes = Some(size);
        }
        for setting in &self.cache_config {
            let (kind, kv) = setting.split_once(',').ok_or_else(|| {
                format!(
                    "--cache-config {setting}: expected <cache>,<key>=<value> (local,size=<bytes> or redis,host=<host>)"
                )
            })?;
            let (key, value) = kv
                .split_once('=')
                .ok_or_else(|| format!("--cache-config {setting}: expected <key>=<value> after '{kind},'"))?;
            match kind {
                "local" => match key {
                    "size" => {
                        settings.local_bytes = Some(value.parse().map_err(|_| {
                            format!("--cache-config {setting}: size must be a number of bytes, got '{value}'")
                        })?)
                    }
                    _ => return Err(format!("--cache-config {setting}: the local cache takes only size=<bytes>")),
                },
                "redis" => redis_setting(redis.get_or_insert_with(RedisSettings::default), key, value)
                    .map_err(|e| format!("--cache-config {setting}: {e}"))?,
                _ => return Err(format!("--cache-config {setting}: unknown cache '{kind}' (local or redis)")),
            }
        }
        if let Some(size) = settings.local_bytes
            && size < MIN_LOCAL
        {
            return Err(format!(
                "--cache-config local,size={size}: too small to hold a response (at least {MIN_LOCAL} bytes)"
            ));
        }
        if let Some(r) = &mut redis {
            if r.host.is_empty() {
                return Err("--cache-config redis: host=<host> is required".into());
            }
            if r.password.is_none() {
                r.password = env("FERRY_CACHE_REDIS_PASSWORD");
            }
        }
        settings.redis = redis;
        Ok((settings.local_bytes.is_some() || settings.redis.is_some()).then_some(settings))
    }
}

fn redis_setting(r: &mut RedisSettings, key: &str, value: &str) -> Result<(), String> {
    let number = |what: &str| value.parse::<u64>().map_err(|_| format!("{key} must be {what}, got '{value}'"));
    let ms = |d: u64| if d == 0 { Duration::from_secs(3600) } else { Duration::from_millis(d) };
    match key {
        "host" => r.host = value.to_string(),
        "port" => r.port = value.parse().map_err(|_| format!("port must be a port number, got '{value}'"))?,
        "user" => r.user = Some(value.to_string()),
        "password" => r.password = Some(value.to_string()),
        "db" => r.db = value.parse().map_err(|_| format!("db must be a database number, got '{value}'"))?,
        "tls_enabled" | "tls" => {
            r.tls = match value {
                "true" | "1" => true,
                "false" | "0" => false,
                _ => return Err(format!("{key} takes true or false, got '{value}'")),
            }
        }
        "prefix" => r.prefix = value.to_string(),
        "ttl" => r.ttl_secs = number("seconds")?,
        "connect_timeout" => r.connect_timeout = ms(number("milliseconds")?),
        "socket_timeout" | "wait_timeout" => r.timeout = ms(number("milliseconds")?),
        // Triton's connection pool: ferry multiplexes one connection, so there is nothing to size.
        "pool_size" => {
            number("a count")?;
        }
        _ => {
            return Err(format!(
                "unknown key '{key}' (host, port, user, password, db, tls_enabled, prefix, ttl, connect_timeout, socket_timeout, pool_size)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str], password: Option<&str>) -> Result<Option<CacheSettings>, String> {
        let args =
            CacheArgs { cache_config: flags.iter().map(|s| s.to_string()).collect(), response_cache_byte_size: None };
        args.resolve(&|k| (k == "FERRY_CACHE_REDIS_PASSWORD").then(|| password.map(String::from)).flatten())
    }

    #[test]
    fn local_and_redis_as_tritonserver_spells_them() {
        assert_eq!(parse(&[], None).unwrap(), None);
        let local = parse(&["local,size=1048576"], None).unwrap().unwrap();
        assert_eq!((local.local_bytes, local.redis), (Some(1 << 20), None));
        let both = parse(
            &["local,size=4096", "redis,host=cache", "redis,port=6380", "redis,ttl=60", "redis,socket_timeout=20"],
            Some("s3cret"),
        )
        .unwrap()
        .unwrap();
        let r = both.redis.unwrap();
        assert_eq!((r.host.as_str(), r.port, r.ttl_secs), ("cache", 6380, 60));
        assert_eq!(r.timeout, Duration::from_millis(20));
        assert_eq!(r.password.as_deref(), Some("s3cret"), "password from the environment");
        let legacy = CacheArgs { cache_config: vec![], response_cache_byte_size: Some(2048) };
        assert_eq!(legacy.resolve(&|_| None).unwrap().unwrap().local_bytes, Some(2048));
    }

    #[test]
    fn mistakes_are_named() {
        for (flags, says) in [
            (&["local,size=lots"][..], "size must be a number of bytes, got 'lots'"),
            (&["local,size=10"][..], "too small"),
            (&["memcached,host=x"][..], "unknown cache 'memcached'"),
            (&["redis,port=6379"][..], "host=<host> is required"),
            (&["redis,host=x", "redis,colour=blue"][..], "unknown key 'colour'"),
            (&["redis"][..], "expected <cache>,<key>=<value>"),
            (&["redis,host=x", "redis,tls_enabled=maybe"][..], "takes true or false"),
        ] {
            let e = parse(flags, None).unwrap_err();
            assert!(e.contains(says), "{flags:?}: {e}");
        }
    }
}
