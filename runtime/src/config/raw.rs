//! The raw file, as serde reads it: every key optional and spanned, so
//! that a check can name the line and column of what is wrong.

use super::*;

pub(super) type Opt<T> = Option<Spanned<T>>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a jobs.toml document")]
pub(super) struct RawConfig {
    pub(super) daemon: RawDaemon,
    pub(super) retention: RawRetention,
    pub(super) defaults: RawLimits,
    pub(super) queues: BTreeMap<Spanned<String>, RawQueue>,
    pub(super) email: RawEmail,
    pub(super) http: BTreeMap<Spanned<String>, RawHttp>,
    pub(super) schedules: BTreeMap<Spanned<String>, RawSchedule>,
    pub(super) store: RawStore,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [daemon] table")]
pub(super) struct RawDaemon {
    pub(super) data_dir: Opt<String>,
    pub(super) plugins_dir: Opt<String>,
    pub(super) listen: Opt<String>,
    pub(super) token: Opt<String>,
    pub(super) token_file: Opt<String>,
    pub(super) allowed_hosts: Opt<Vec<String>>,
    pub(super) header_timeout: Opt<String>,
    pub(super) request_timeout: Opt<String>,
    pub(super) max_connections: Opt<RawInt>,
    pub(super) max_request: Opt<RawSize>,
    pub(super) shutdown_grace: Opt<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [retention] table")]
pub(super) struct RawRetention {
    pub(super) jobs: Opt<String>,
    pub(super) dead: Opt<String>,
    pub(super) fences: Opt<String>,
    pub(super) tombstones: Opt<String>,
    pub(super) kv: BTreeMap<Spanned<String>, Spanned<String>>,
}

/// `[defaults]`, and the same fields of a queue.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [defaults] table")]
pub(super) struct RawLimits {
    pub(super) concurrency: Opt<RawInt>,
    pub(super) timeout: Opt<String>,
    pub(super) max_attempts: Opt<RawInt>,
    pub(super) backoff: Opt<RawBackoff>,
    pub(super) memory: Opt<RawSize>,
    pub(super) on_uncertain: Opt<String>,
    pub(super) rate_limit: Opt<RawRateLimit>,
    pub(super) max_payload: Opt<RawSize>,
    pub(super) max_result: Opt<RawSize>,
}

#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a table such as { initial = \"1s\", max = \"10m\", multiplier = 2.0, jitter = 0.2 }"
)]
pub(super) struct RawBackoff {
    pub(super) initial: Opt<String>,
    pub(super) max: Opt<String>,
    pub(super) multiplier: Opt<RawFloat>,
    pub(super) jitter: Opt<RawFloat>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as { max = 100, per = \"1s\" }"
)]
pub(super) struct RawRateLimit {
    pub(super) max: Spanned<RawInt>,
    pub(super) per: Spanned<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [queues.NAME] table")]
pub(super) struct RawQueue {
    pub(super) plugin: Opt<String>,
    pub(super) namespace: Opt<String>,
    pub(super) grants: Opt<RawGrants>,
    pub(super) concurrency: Opt<RawInt>,
    pub(super) timeout: Opt<String>,
    pub(super) max_attempts: Opt<RawInt>,
    pub(super) backoff: Opt<RawBackoff>,
    pub(super) memory: Opt<RawSize>,
    pub(super) on_uncertain: Opt<String>,
    pub(super) rate_limit: Opt<RawRateLimit>,
    pub(super) max_payload: Opt<RawSize>,
    pub(super) max_result: Opt<RawSize>,
}

impl RawQueue {
    /// The fields a queue shares with `[defaults]`.
    pub(super) fn limits(&mut self) -> RawLimits {
        RawLimits {
            concurrency: self.concurrency.take(),
            timeout: self.timeout.take(),
            max_attempts: self.max_attempts.take(),
            backoff: self.backoff.take(),
            memory: self.memory.take(),
            on_uncertain: self.on_uncertain.take(),
            rate_limit: self.rate_limit.take(),
            max_payload: self.max_payload.take(),
            max_result: self.max_result.take(),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a table such as { kv = true, email = true, index = [\"products\"], http = [\"payments\"] }"
)]
pub(super) struct RawGrants {
    pub(super) kv: Option<bool>,
    pub(super) email: Option<bool>,
    pub(super) index: Vec<Spanned<String>>,
    pub(super) http: Vec<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "an [email] table")]
pub(super) struct RawEmail {
    pub(super) transport: Opt<String>,
    pub(super) from: Opt<String>,
    pub(super) senders: Opt<Vec<String>>,
    pub(super) host: Opt<String>,
    pub(super) port: Opt<RawInt>,
    pub(super) tls: Opt<String>,
    pub(super) username: Opt<RawSecret>,
    pub(super) password: Opt<RawSecret>,
    pub(super) timeout: Opt<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "an [http.NAME] table")]
pub(super) struct RawHttp {
    pub(super) base_url: Opt<String>,
    pub(super) idempotency_header: Opt<String>,
    pub(super) timeout: Opt<String>,
    pub(super) headers: BTreeMap<Spanned<String>, Spanned<RawSecret>>,
    pub(super) max_response: Opt<RawSize>,
    pub(super) reconcile: Opt<RawReconcile>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as { method = \"GET\", path = \"/v1/charges\" }"
)]
pub(super) struct RawReconcile {
    pub(super) method: Spanned<String>,
    pub(super) path: Spanned<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [schedules.NAME] table")]
pub(super) struct RawSchedule {
    pub(super) queue: Opt<String>,
    pub(super) cron: Opt<String>,
    pub(super) timezone: Opt<String>,
    pub(super) payload: Opt<toml::Table>,
    pub(super) catch_up: Opt<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default, expecting = "a [store] table")]
pub(super) struct RawStore {
    pub(super) backend: Opt<String>,
    pub(super) url: Opt<RawSecret>,
    pub(super) pool: Opt<RawInt>,
    pub(super) lease: Opt<String>,
    pub(super) heartbeat: Opt<String>,
    pub(super) cache: Opt<RawSize>,
}

/// A size: `"64MiB"` or a number of bytes.
pub(super) enum RawSize {
    Bytes(i64),
    Text(String),
}

impl<'de> Deserialize<'de> for RawSize {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = RawSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"64MiB\" or a number of bytes")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawSize, E> {
                Ok(RawSize::Bytes(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawSize, E> {
                Ok(RawSize::Bytes(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawSize, E> {
                Ok(RawSize::Text(v.to_owned()))
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

/// An integer (only so that a wrong type reads "expected an integer").
pub(super) struct RawInt(pub(super) i64);

impl<'de> Deserialize<'de> for RawInt {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = RawInt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawInt, E> {
                Ok(RawInt(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawInt, E> {
                Ok(RawInt(i64::try_from(v).unwrap_or(i64::MAX)))
            }
        }
        deserializer.deserialize_any(IntVisitor)
    }
}

/// A number, integer or float.
pub(super) struct RawFloat(pub(super) f64);

impl<'de> Deserialize<'de> for RawFloat {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FloatVisitor;
        impl Visitor<'_> for FloatVisitor {
            type Value = RawFloat;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<RawFloat, E> {
                Ok(RawFloat(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawFloat, E> {
                Ok(RawFloat(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawFloat, E> {
                Ok(RawFloat(v as f64))
            }
        }
        deserializer.deserialize_any(FloatVisitor)
    }
}

/// A secret: a string, `{ env = "VAR", prefix = "..." }` or `{ file = "...", prefix = "..." }`.
pub(super) enum RawSecret {
    Plain(String),
    Table(RawSecretTable),
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "{ env = \"VAR\" } or { file = \"/path\" }"
)]
pub(super) struct RawSecretTable {
    pub(super) env: Opt<String>,
    pub(super) file: Opt<String>,
    pub(super) prefix: Opt<String>,
}

impl<'de> Deserialize<'de> for RawSecret {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SecretVisitor;
        impl<'de> Visitor<'de> for SecretVisitor {
            type Value = RawSecret;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, { env = \"VAR\" } or { file = \"/path\" }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawSecret, E> {
                Ok(RawSecret::Plain(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawSecret, A::Error> {
                RawSecretTable::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(RawSecret::Table)
            }
        }
        deserializer.deserialize_any(SecretVisitor)
    }
}
