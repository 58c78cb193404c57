//! Validation and resolution: the [`Checker`] that walks the raw file,
//! collects every issue with its place, and resolves `[daemon]`, the
//! defaults and the limits.

use super::*;

/// The fields of `[defaults]`, resolved.
#[derive(Clone)]
pub(super) struct Limits {
    pub(super) concurrency: u32,
    pub(super) timeout: Duration,
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) memory: u64,
    pub(super) on_uncertain: OnUncertain,
    pub(super) rate_limit: Option<RateLimit>,
    pub(super) max_payload: u64,
    pub(super) max_result: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            concurrency: 4,
            timeout: Duration::from_secs(30),
            max_attempts: 5,
            backoff: Backoff::default(),
            memory: 64 * MIB,
            on_uncertain: OnUncertain::Skip,
            rate_limit: None,
            max_payload: MIB,
            max_result: MIB,
        }
    }
}

pub(super) const ON_UNCERTAIN: &[(&str, OnUncertain)] = &[
    ("skip", OnUncertain::Skip),
    ("repeat", OnUncertain::Repeat),
    ("dead", OnUncertain::Dead),
];
pub(super) const TRANSPORTS: &[(&str, EmailTransport)] = &[
    ("outbox", EmailTransport::Outbox),
    ("smtp", EmailTransport::Smtp),
];
pub(super) const TLS: &[(&str, SmtpTls)] = &[
    ("none", SmtpTls::None),
    ("starttls", SmtpTls::Starttls),
    ("tls", SmtpTls::Tls),
];
pub(super) const CATCH_UP: &[(&str, CatchUp)] = &[
    ("latest", CatchUp::Latest),
    ("all", CatchUp::All),
    ("none", CatchUp::None),
];
pub(super) const BACKENDS: &[(&str, Backend)] = &[
    ("sqlite", Backend::Sqlite),
    ("sled", Backend::Sled),
    ("postgres", Backend::Postgres),
];

/// Collects issues while turning the raw file into a [`Config`].
pub(super) struct Checker<'a> {
    pub(super) text: &'a str,
    pub(super) path: &'a Path,
    /// The directory relative paths are resolved against.
    pub(super) base_dir: PathBuf,
    /// Byte offsets at which lines start.
    pub(super) line_starts: Vec<usize>,
    pub(super) issues: Vec<ConfigIssue>,
}

impl<'a> Checker<'a> {
    pub(super) fn new(text: &'a str, path: &'a Path) -> Self {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Checker {
            text,
            path,
            base_dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            line_starts,
            issues: Vec::new(),
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    pub(super) fn position(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.line_starts.partition_point(|&start| start <= offset) - 1;
        let start = self.line_starts[line];
        let column = match self.text.get(start..offset) {
            Some(before) => before.chars().count(),
            None => offset - start,
        };
        (line + 1, column + 1)
    }

    pub(super) fn issue(
        &mut self,
        key: &str,
        span: Option<Range<usize>>,
        message: impl Into<String>,
    ) {
        let (line, column) = match span {
            Some(span) => {
                let (line, column) = self.position(span.start);
                (Some(line), Some(column))
            }
            None => (None, None),
        };
        self.issues.push(ConfigIssue {
            key: key.to_owned(),
            line,
            column,
            message: message.into(),
        });
    }

    /// Pass 1: syntax, unknown keys and types. `None` when an issue was recorded.
    pub(super) fn deserialize(&mut self) -> Option<RawConfig> {
        let text = self.text;
        let (document, syntax_errors) = toml::de::DeTable::parse_recoverable(text);
        if !syntax_errors.is_empty() {
            for error in syntax_errors {
                let key = error
                    .span()
                    .map(|span| key_at(document.get_ref(), span.start))
                    .unwrap_or_default();
                self.issue(&key, error.span(), error.message());
            }
            return None;
        }
        match toml::from_str::<RawConfig>(text) {
            Ok(raw) => Some(raw),
            Err(error) => {
                let key = error
                    .span()
                    .map(|span| key_at(document.get_ref(), span.start))
                    .unwrap_or_default();
                self.issue(&key, error.span(), error.message());
                None
            }
        }
    }

    /// Pass 2: every semantic check, collecting all issues.
    pub(super) fn resolve(&mut self, mut raw: RawConfig) -> Config {
        let daemon = self.daemon(&raw.daemon);
        let defaults = self.limits("defaults", &raw.defaults, &Limits::default());

        let mut http = BTreeMap::new();
        for (name, provider) in &raw.http {
            let key = join("http", name.get_ref());
            self.name(&key, "provider name", name);
            http.insert(name.get_ref().clone(), self.http(&key, name, provider));
        }

        let mut queues = BTreeMap::new();
        for (name, queue) in &mut raw.queues {
            let key = join("queues", name.get_ref());
            let resolved = self.queue(&key, name, queue, &defaults, &http);
            queues.insert(name.get_ref().clone(), resolved);
        }

        let retention = self.retention(&raw.retention, &queues);
        let email = self.email(&raw.email);

        let mut schedules = BTreeMap::new();
        for (name, schedule) in &raw.schedules {
            let key = join("schedules", name.get_ref());
            let resolved = self.schedule(&key, name, schedule, &queues);
            schedules.insert(name.get_ref().clone(), resolved);
        }

        let store = self.store(&raw.store);

        Config {
            path: self.path.to_path_buf(),
            daemon,
            retention,
            queues,
            email,
            http,
            schedules,
            store,
        }
    }

    pub(super) fn daemon(&mut self, raw: &RawDaemon) -> Daemon {
        let defaults = Daemon::default();
        let data_dir = self.dir("daemon.data_dir", raw.data_dir.as_ref(), "data");
        let plugins_dir = self.dir("daemon.plugins_dir", raw.plugins_dir.as_ref(), "plugins");
        let listen = match &raw.listen {
            None => defaults.listen,
            Some(listen) => match listen.get_ref().trim().parse::<SocketAddr>() {
                Ok(addr) => addr,
                Err(e) => {
                    self.issue(
                        "daemon.listen",
                        Some(listen.span()),
                        format!(
                            "invalid address {:?}: {e}; expected IP:PORT such as \"127.0.0.1:7373\" or \"[::1]:7373\"",
                            listen.get_ref()
                        ),
                    );
                    defaults.listen
                }
            },
        };

        // A token was configured, even if it could not be read: do not also
        // complain that there is none.
        let token_given = raw.token.is_some() || raw.token_file.is_some();
        let mut token = None;
        if let (Some(_), Some(file)) = (&raw.token, &raw.token_file) {
            self.issue(
                "daemon.token_file",
                Some(file.span()),
                "give either daemon.token or daemon.token_file, not both",
            );
        } else if let Some(inline) = &raw.token {
            if inline.get_ref().trim().is_empty() {
                self.issue("daemon.token", Some(inline.span()), "the token is empty");
            } else {
                token = Some(inline.get_ref().trim().to_owned());
            }
        } else if let Some(file) = &raw.token_file {
            let path = resolve_path(&self.base_dir, file.get_ref());
            match std::fs::read_to_string(&path) {
                Ok(contents) if contents.trim().is_empty() => self.issue(
                    "daemon.token_file",
                    Some(file.span()),
                    format!("the token file {} is empty", path.display()),
                ),
                Ok(contents) => token = Some(contents.trim().to_owned()),
                Err(e) => self.issue(
                    "daemon.token_file",
                    Some(file.span()),
                    format!("cannot read the token file {}: {e}", path.display()),
                ),
            }
        }
        if let Some(t) = &token
            && t.len() < MIN_TOKEN
        {
            let (key, span) = match &raw.token {
                Some(inline) => ("daemon.token", Some(inline.span())),
                None => (
                    "daemon.token_file",
                    raw.token_file.as_ref().map(Spanned::span),
                ),
            };
            self.issue(
                key,
                span,
                format!(
                    "the token is {} bytes; a token must be at least {MIN_TOKEN} bytes (make one with `head -c 32 /dev/urandom | base64`)",
                    t.len()
                ),
            );
            token = None;
        }
        let mut allowed_hosts = Vec::new();
        if let Some(names) = &raw.allowed_hosts {
            for name in names.get_ref() {
                let ok = !name.is_empty()
                    && name.len() <= 253
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
                if ok {
                    allowed_hosts.push(name.to_ascii_lowercase());
                } else {
                    self.issue(
                        "daemon.allowed_hosts",
                        Some(names.span()),
                        format!(
                            "{name:?} is not a host name (letters, digits, '-' and '.', no port)"
                        ),
                    );
                }
            }
        }
        if !token_given && !listen.ip().is_loopback() {
            let span = raw.listen.as_ref().map(Spanned::span);
            self.issue(
                "daemon.listen",
                span,
                format!(
                    "{listen} is not a loopback address and no token is configured: \
                     set daemon.token_file (or daemon.token), or listen on 127.0.0.1"
                ),
            );
        }

        let shutdown_grace = self
            .duration("daemon.shutdown_grace", raw.shutdown_grace.as_ref(), false)
            .unwrap_or(defaults.shutdown_grace);
        let header_timeout = self
            .duration("daemon.header_timeout", raw.header_timeout.as_ref(), true)
            .unwrap_or(defaults.header_timeout);
        let request_timeout = self
            .duration("daemon.request_timeout", raw.request_timeout.as_ref(), true)
            .unwrap_or(defaults.request_timeout);
        let max_connections = self
            .int(
                "daemon.max_connections",
                raw.max_connections.as_ref(),
                1,
                1_000_000,
            )
            .map_or(defaults.max_connections, |n| n as u32);
        let max_request = self
            .size("daemon.max_request", raw.max_request.as_ref(), 1 << 10)
            .unwrap_or(defaults.max_request);
        Daemon {
            data_dir,
            plugins_dir,
            listen,
            token,
            allowed_hosts,
            header_timeout,
            request_timeout,
            max_connections,
            max_request,
            shutdown_grace,
        }
    }

    pub(super) fn dir(
        &mut self,
        key: &str,
        raw: Option<&Spanned<String>>,
        default: &str,
    ) -> PathBuf {
        match raw {
            Some(value) if value.get_ref().trim().is_empty() => {
                self.issue(key, Some(value.span()), "the path is empty");
                resolve_path(&self.base_dir, default)
            }
            Some(value) => resolve_path(&self.base_dir, value.get_ref()),
            None => resolve_path(&self.base_dir, default),
        }
    }

    /// `[defaults]` or a queue's own fields, on top of `base`.
    pub(super) fn limits(&mut self, prefix: &str, raw: &RawLimits, base: &Limits) -> Limits {
        let key = |field: &str| join(prefix, field);
        let concurrency = self
            .int(
                &key("concurrency"),
                raw.concurrency.as_ref(),
                1,
                i64::from(u32::MAX),
            )
            .map_or(base.concurrency, |v| v as u32);
        let timeout = self
            .duration(&key("timeout"), raw.timeout.as_ref(), true)
            .unwrap_or(base.timeout);
        let max_attempts = self
            .int(
                &key("max_attempts"),
                raw.max_attempts.as_ref(),
                1,
                i64::from(crate::job::MAX_ATTEMPTS),
            )
            .map_or(base.max_attempts, |v| v as u32);
        let backoff = match &raw.backoff {
            Some(backoff) => self.backoff(&key("backoff"), backoff, &base.backoff),
            None => base.backoff.clone(),
        };
        let memory = self
            .size(&key("memory"), raw.memory.as_ref(), WASM_PAGE)
            .unwrap_or(base.memory);
        let on_uncertain = self
            .choice(
                &key("on_uncertain"),
                raw.on_uncertain.as_ref(),
                ON_UNCERTAIN,
            )
            .unwrap_or(base.on_uncertain);
        let rate_limit = match &raw.rate_limit {
            Some(limit) => {
                let prefix = key("rate_limit");
                let max = self.int(
                    &join(&prefix, "max"),
                    Some(&limit.get_ref().max),
                    1,
                    i64::from(u32::MAX),
                );
                let per = self.duration(&join(&prefix, "per"), Some(&limit.get_ref().per), true);
                match (max, per) {
                    (Some(max), Some(per)) => Some(RateLimit {
                        max: max as u32,
                        per,
                    }),
                    _ => base.rate_limit.clone(),
                }
            }
            None => base.rate_limit.clone(),
        };
        let max_payload = self
            .size(&key("max_payload"), raw.max_payload.as_ref(), 1)
            .unwrap_or(base.max_payload);
        let max_result = self
            .size(&key("max_result"), raw.max_result.as_ref(), 1)
            .unwrap_or(base.max_result);
        Limits {
            concurrency,
            timeout,
            max_attempts,
            backoff,
            memory,
            on_uncertain,
            rate_limit,
            max_payload,
            max_result,
        }
    }

    pub(super) fn backoff(
        &mut self,
        prefix: &str,
        raw: &Spanned<RawBackoff>,
        base: &Backoff,
    ) -> Backoff {
        let fields = raw.get_ref();
        let initial = self.duration(&join(prefix, "initial"), fields.initial.as_ref(), true);
        let max = self.duration(&join(prefix, "max"), fields.max.as_ref(), true);
        let multiplier = self.float(
            &join(prefix, "multiplier"),
            fields.multiplier.as_ref(),
            |m| (1.0..=1e6).contains(&m),
            "must be at least 1.0 (and at most 1000000)",
        );
        let jitter = self.float(
            &join(prefix, "jitter"),
            fields.jitter.as_ref(),
            |j| (0.0..=1.0).contains(&j),
            "must be between 0.0 and 1.0",
        );
        let backoff = Backoff {
            initial: initial.unwrap_or(base.initial),
            max: max.unwrap_or(base.max),
            multiplier: multiplier.unwrap_or(base.multiplier),
            jitter: jitter.unwrap_or(base.jitter),
        };
        let checked_fields_ok = fields.initial.is_none() || initial.is_some();
        let checked_fields_ok = checked_fields_ok && (fields.max.is_none() || max.is_some());
        if checked_fields_ok && backoff.max < backoff.initial {
            let (field, span) = match (&fields.max, &fields.initial) {
                (Some(max), _) => ("max", max.span()),
                (None, Some(initial)) => ("initial", initial.span()),
                (None, None) => ("max", raw.span()),
            };
            self.issue(
                &join(prefix, field),
                Some(span),
                format!(
                    "backoff max ({}) is shorter than initial ({})",
                    humantime::format_duration(backoff.max),
                    humantime::format_duration(backoff.initial)
                ),
            );
        }
        backoff
    }
}
