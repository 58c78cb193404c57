//! The checks of the sections: queues, email, HTTP providers, schedules,
//! the store and retention.

use super::*;

impl<'a> Checker<'a> {
    pub(super) fn queue(
        &mut self,
        key: &str,
        name: &Spanned<String>,
        raw: &mut RawQueue,
        defaults: &Limits,
        http: &BTreeMap<String, HttpProvider>,
    ) -> Queue {
        self.name(key, "queue name", name);
        let plugin = match &raw.plugin {
            Some(plugin) => {
                self.name(&join(key, "plugin"), "plugin name", plugin);
                plugin.get_ref().clone()
            }
            None => {
                self.issue(
                    &join(key, "plugin"),
                    Some(name.span()),
                    "missing: every queue needs `plugin = \"NAME\"` (loaded from plugins_dir/NAME.wasm)",
                );
                String::new()
            }
        };
        let namespace = match &raw.namespace {
            Some(namespace) => {
                self.name(&join(key, "namespace"), "namespace", namespace);
                namespace.get_ref().clone()
            }
            None => name.get_ref().clone(),
        };

        let mut grants = Grants::default();
        if let Some(raw_grants) = &raw.grants {
            let prefix = join(key, "grants");
            let raw_grants = raw_grants.get_ref();
            grants.kv = raw_grants.kv.unwrap_or(false);
            grants.email = raw_grants.email.unwrap_or(false);
            for (i, collection) in raw_grants.index.iter().enumerate() {
                let item = format!("{}[{i}]", join(&prefix, "index"));
                if self.name(&item, "index collection name", collection)
                    && !grants.index.contains(collection.get_ref())
                {
                    grants.index.push(collection.get_ref().clone());
                }
            }
            for (i, provider) in raw_grants.http.iter().enumerate() {
                let item = format!("{}[{i}]", join(&prefix, "http"));
                if !http.contains_key(provider.get_ref()) {
                    let known: Vec<String> = http.keys().map(|k| format!("{k:?}")).collect();
                    let known = if known.is_empty() {
                        "there are none".to_owned()
                    } else {
                        format!("known: {}", known.join(", "))
                    };
                    self.issue(
                        &item,
                        Some(provider.span()),
                        format!(
                            "no [http.{}] provider is configured ({known})",
                            quote_key(provider.get_ref())
                        ),
                    );
                } else if !grants.http.contains(provider.get_ref()) {
                    grants.http.push(provider.get_ref().clone());
                }
            }
        }

        let own = raw.limits();
        let limits = self.limits(key, &own, defaults);
        Queue {
            name: name.get_ref().clone(),
            plugin,
            namespace,
            grants,
            concurrency: limits.concurrency,
            timeout: limits.timeout,
            max_attempts: limits.max_attempts,
            backoff: limits.backoff,
            memory: limits.memory,
            on_uncertain: limits.on_uncertain,
            rate_limit: limits.rate_limit,
            max_payload: limits.max_payload,
            max_result: limits.max_result,
        }
    }

    pub(super) fn email(&mut self, raw: &RawEmail) -> Email {
        let defaults = Email::default();
        let transport = self
            .choice("email.transport", raw.transport.as_ref(), TRANSPORTS)
            .unwrap_or(defaults.transport);
        let from = match &raw.from {
            Some(from) => {
                let value = from.get_ref().trim();
                if !value.contains('@') || value.starts_with('@') || value.ends_with('@') {
                    self.issue(
                        "email.from",
                        Some(from.span()),
                        format!("{:?} is not an email address", from.get_ref()),
                    );
                }
                value.to_owned()
            }
            None => defaults.from,
        };
        let mut senders = Vec::new();
        if let Some(list) = &raw.senders {
            for address in list.get_ref() {
                let a = address.trim();
                if !a.contains('@')
                    || a.starts_with('@')
                    || a.ends_with('@')
                    || a.contains(['<', '>', ' '])
                {
                    self.issue(
                        "email.senders",
                        Some(list.span()),
                        format!("{address:?} is not an email address (give the bare address, as \"reports@example.com\")"),
                    );
                } else {
                    senders.push(a.to_ascii_lowercase());
                }
            }
        }
        let host = match &raw.host {
            Some(host) if host.get_ref().trim().is_empty() => {
                self.issue("email.host", Some(host.span()), "the host is empty");
                defaults.host
            }
            Some(host) => host.get_ref().trim().to_owned(),
            None => defaults.host,
        };
        let port = self
            .int("email.port", raw.port.as_ref(), 1, i64::from(u16::MAX))
            .map_or(defaults.port, |p| p as u16);
        let tls = self
            .choice("email.tls", raw.tls.as_ref(), TLS)
            .unwrap_or(defaults.tls);
        let username = raw
            .username
            .as_ref()
            .and_then(|s| self.secret("email.username", s));
        let password = raw
            .password
            .as_ref()
            .and_then(|s| self.secret("email.password", s));
        match (&raw.username, &raw.password) {
            (Some(username), None) => self.issue(
                "email.password",
                Some(username.span()),
                "email.username is set but email.password is not",
            ),
            (None, Some(password)) => self.issue(
                "email.username",
                Some(password.span()),
                "email.password is set but email.username is not",
            ),
            _ => {}
        }
        let timeout = self
            .duration("email.timeout", raw.timeout.as_ref(), true)
            .unwrap_or(defaults.timeout);
        Email {
            transport,
            from,
            senders,
            host,
            port,
            tls,
            username,
            password,
            timeout,
        }
    }

    pub(super) fn http(
        &mut self,
        key: &str,
        name: &Spanned<String>,
        raw: &RawHttp,
    ) -> HttpProvider {
        let base_url = match &raw.base_url {
            Some(url) => {
                let value = url.get_ref().trim();
                let rest = value
                    .strip_prefix("http://")
                    .or_else(|| value.strip_prefix("https://"));
                let host_ok = rest.is_some_and(|rest| {
                    !rest.is_empty()
                        && !rest.starts_with('/')
                        && !rest.contains(char::is_whitespace)
                });
                if !host_ok {
                    self.issue(
                        &join(key, "base_url"),
                        Some(url.span()),
                        format!(
                            "{:?} is not an http:// or https:// URL with a host",
                            url.get_ref()
                        ),
                    );
                }
                value.trim_end_matches('/').to_owned()
            }
            None => {
                self.issue(
                    &join(key, "base_url"),
                    Some(name.span()),
                    "missing: every provider needs `base_url = \"https://...\"`",
                );
                String::new()
            }
        };
        let idempotency_header = raw.idempotency_header.as_ref().map(|header| {
            self.header_name(&join(key, "idempotency_header"), header);
            header.get_ref().clone()
        });
        let timeout = self
            .duration(&join(key, "timeout"), raw.timeout.as_ref(), true)
            .unwrap_or(Duration::from_secs(10));
        let mut headers = BTreeMap::new();
        let headers_key = join(key, "headers");
        for (header, value) in &raw.headers {
            let header_key = join(&headers_key, header.get_ref());
            self.header_name(&header_key, header);
            if let Some(secret) = self.secret(&header_key, value) {
                headers.insert(header.get_ref().clone(), secret);
            }
        }
        let max_response = self
            .size(&join(key, "max_response"), raw.max_response.as_ref(), 1)
            .unwrap_or(MIB);
        let reconcile = raw.reconcile.as_ref().map(|reconcile| {
            let prefix = join(key, "reconcile");
            let fields = reconcile.get_ref();
            let method = fields.method.get_ref().trim().to_ascii_uppercase();
            if method.is_empty() || !method.chars().all(|c| c.is_ascii_uppercase()) {
                self.issue(
                    &join(&prefix, "method"),
                    Some(fields.method.span()),
                    format!("{:?} is not an HTTP method", fields.method.get_ref()),
                );
            }
            let path = fields.path.get_ref().trim().to_owned();
            if !path.starts_with('/') {
                self.issue(
                    &join(&prefix, "path"),
                    Some(fields.path.span()),
                    format!(
                        "{:?} must start with `/` (it is relative to base_url)",
                        fields.path.get_ref()
                    ),
                );
            }
            Reconcile { method, path }
        });
        HttpProvider {
            name: name.get_ref().clone(),
            base_url,
            idempotency_header,
            timeout,
            headers,
            max_response,
            reconcile,
        }
    }

    pub(super) fn schedule(
        &mut self,
        key: &str,
        name: &Spanned<String>,
        raw: &RawSchedule,
        queues: &BTreeMap<String, Queue>,
    ) -> Schedule {
        self.name(key, "schedule name", name);
        let queue = match &raw.queue {
            Some(queue) => {
                if !queues.contains_key(queue.get_ref()) {
                    self.issue(
                        &join(key, "queue"),
                        Some(queue.span()),
                        format!("no [queues.{}] is configured", quote_key(queue.get_ref())),
                    );
                }
                queue.get_ref().clone()
            }
            None => {
                self.issue(
                    &join(key, "queue"),
                    Some(name.span()),
                    "missing: every schedule needs `queue = \"NAME\"`",
                );
                String::new()
            }
        };
        let cron = match &raw.cron {
            Some(cron) => {
                let fields = cron.get_ref().split_whitespace().count();
                if fields == 5
                    && let Err(message) = parse_cron(cron.get_ref())
                {
                    self.issue(&join(key, "cron"), Some(cron.span()), message);
                }
                if fields != 5 {
                    self.issue(
                        &join(key, "cron"),
                        Some(cron.span()),
                        format!(
                            "{:?} has {fields} fields; expected the 5 of standard cron \
                             (minute hour day-of-month month day-of-week)",
                            cron.get_ref()
                        ),
                    );
                }
                cron.get_ref()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            }
            None => {
                self.issue(
                    &join(key, "cron"),
                    Some(name.span()),
                    "missing: every schedule needs `cron = \"MIN HOUR DOM MON DOW\"`",
                );
                String::new()
            }
        };
        let timezone = match &raw.timezone {
            Some(tz) if tz.get_ref().trim().is_empty() => {
                self.issue(
                    &join(key, "timezone"),
                    Some(tz.span()),
                    "the timezone is empty",
                );
                "UTC".to_owned()
            }
            Some(tz) => {
                if let Err(message) = parse_timezone(tz.get_ref().trim()) {
                    self.issue(&join(key, "timezone"), Some(tz.span()), message);
                }
                tz.get_ref().trim().to_owned()
            }
            None => "UTC".to_owned(),
        };
        let payload = match &raw.payload {
            Some(payload) => match table_to_json(payload.get_ref()) {
                Ok(json) => json,
                Err(message) => {
                    self.issue(&join(key, "payload"), Some(payload.span()), message);
                    serde_json::Value::Object(serde_json::Map::new())
                }
            },
            None => serde_json::Value::Object(serde_json::Map::new()),
        };
        let catch_up = self
            .choice(&join(key, "catch_up"), raw.catch_up.as_ref(), CATCH_UP)
            .unwrap_or(CatchUp::Latest);
        Schedule {
            name: name.get_ref().clone(),
            queue,
            cron,
            timezone,
            payload,
            catch_up,
        }
    }

    pub(super) fn store(&mut self, raw: &RawStore) -> StoreConfig {
        let defaults = StoreConfig::default();
        let backend = self
            .choice("store.backend", raw.backend.as_ref(), BACKENDS)
            .unwrap_or(defaults.backend);
        let url = raw
            .url
            .as_ref()
            .and_then(|url| self.secret("store.url", url));
        match (backend, &raw.url) {
            (Backend::Postgres, None) => {
                let span = raw.backend.as_ref().map(Spanned::span);
                self.issue(
                    "store.url",
                    span,
                    "missing: backend \"postgres\" needs `url` (a string, { env = \"VAR\" } or { file = \"/path\" })",
                );
            }
            (Backend::Postgres, Some(raw_url)) => {
                // An inline URL is checked now; one from `env` or `file`
                // when the daemon reads it. The message never repeats the
                // URL: it may hold a password.
                if let Some(Secret::Plain(text)) = &url
                    && let Err(e) = text.parse::<tokio_postgres::Config>()
                {
                    let cause = std::error::Error::source(&e)
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default();
                    self.issue(
                        "store.url",
                        Some(raw_url.span()),
                        format!(
                            "not a PostgreSQL connection URL ({e}{cause}); expected e.g. \"postgres://user:password@host:5432/khata\""
                        ),
                    );
                }
            }
            (Backend::Sqlite | Backend::Sled, Some(url)) => self.issue(
                "store.url",
                Some(url.span()),
                format!(
                    "url is only used by backend \"postgres\"; backend is \"{}\" (the ledger is kept in data_dir)",
                    backend.as_str()
                ),
            ),
            _ => {}
        }
        let pool = self
            .int("store.pool", raw.pool.as_ref(), 1, 10_000)
            .map_or(defaults.pool, |p| p as u32);
        let lease = self.duration("store.lease", raw.lease.as_ref(), true);
        let heartbeat = self.duration("store.heartbeat", raw.heartbeat.as_ref(), true);
        let cache = self.size("store.cache", raw.cache.as_ref(), MIB);
        if let Some(c) = &raw.cache
            && backend != Backend::Sled
        {
            self.issue(
                "store.cache",
                Some(c.span()),
                format!(
                    "cache is only used by backend \"sled\" (its page cache); backend is \"{}\"",
                    backend.as_str()
                ),
            );
        }
        let resolved = StoreConfig {
            backend,
            url,
            pool,
            lease: lease.unwrap_or(defaults.lease),
            heartbeat: heartbeat.unwrap_or(defaults.heartbeat),
            cache: cache.unwrap_or(defaults.cache),
        };
        let values_ok = (raw.lease.is_none() || lease.is_some())
            && (raw.heartbeat.is_none() || heartbeat.is_some());
        if values_ok && resolved.heartbeat >= resolved.lease {
            let (key, span) = match (&raw.heartbeat, &raw.lease) {
                (Some(h), _) => ("store.heartbeat", Some(h.span())),
                (None, Some(l)) => ("store.lease", Some(l.span())),
                (None, None) => ("store.heartbeat", None),
            };
            self.issue(
                key,
                span,
                format!(
                    "heartbeat ({}) must be shorter than lease ({}), or every lease expires",
                    humantime::format_duration(resolved.heartbeat),
                    humantime::format_duration(resolved.lease)
                ),
            );
        }
        resolved
    }

    /// `[retention]`; a kv rule must name a namespace some queue writes
    /// (a misspelt one would silently keep everything).
    pub(super) fn retention(
        &mut self,
        raw: &RawRetention,
        queues: &BTreeMap<String, Queue>,
    ) -> Retention {
        let base = Retention::default();
        let mut window = |key: &str, raw: &Opt<String>, default: Duration| {
            self.duration(key, raw.as_ref(), true).unwrap_or(default)
        };
        let mut retention = Retention {
            jobs: window("retention.jobs", &raw.jobs, base.jobs),
            dead: window("retention.dead", &raw.dead, base.dead),
            fences: window("retention.fences", &raw.fences, base.fences),
            tombstones: window("retention.tombstones", &raw.tombstones, base.tombstones),
            kv: BTreeMap::new(),
        };
        for (ns, raw_window) in &raw.kv {
            let key = join("retention.kv", ns.get_ref());
            let Some(window) = self.duration(&key, Some(raw_window), true) else {
                continue;
            };
            if !queues.values().any(|q| q.namespace == *ns.get_ref()) {
                let mut known: Vec<&str> = queues.values().map(|q| q.namespace.as_str()).collect();
                known.sort_unstable();
                known.dedup();
                self.issue(
                    &key,
                    Some(ns.span()),
                    format!(
                        "no queue writes the kv namespace {:?} (the queues' namespaces: {})",
                        ns.get_ref(),
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
                continue;
            }
            retention.kv.insert(ns.get_ref().clone(), window);
        }
        retention
    }
}
