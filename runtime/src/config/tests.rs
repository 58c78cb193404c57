use super::*;

/// A configuration that uses every section of docs/jobs-toml.md, with the
/// queue the schedule names.
const FULL_EXAMPLE: &str = r#"
[daemon]
data_dir = "./data"            # the ledger (khata.db) and the email outbox
plugins_dir = "./plugins"      # <name>.wasm, watched for changes
listen = "127.0.0.1:7373"
# token_file = "/etc/khata/token"
# shutdown_grace = "30s"

[retention]
jobs = "7d"
fences = "30d"

[defaults]                      # every queue inherits these
concurrency = 4
timeout = "30s"
max_attempts = 5
backoff = { initial = "1s", max = "10m", multiplier = 2.0, jitter = 0.2 }
memory = "64MiB"
on_uncertain = "skip"           # skip | repeat | dead
# rate_limit = { max = 100, per = "1s" }   # attempts started per queue, as BullMQ's limiter
# max_payload = "1MiB"  max_result = "1MiB"

[queues.welcome-email]
plugin = "welcome_email"
namespace = "users"
grants = { kv = true, email = true }

[queues.charge-customer]
plugin = "charge_customer"
grants = { http = ["payments"] }

[queues.update-search-index]
plugin = "update_search_index"
grants = { kv = true, index = ["products"] }

[queues.generate-report]
plugin = "generate_report"
grants = { kv = true, email = true }

[email]
transport = "outbox"            # or "smtp"
from = "noreply@example.com"
# host = "127.0.0.1"  port = 2525  tls = "none" | "starttls" | "tls"

[http.payments]
base_url = "http://127.0.0.1:12111"
idempotency_header = "Idempotency-Key"
timeout = "10s"
headers = { Authorization = { env = "PAYMENTS_TOKEN", prefix = "Bearer " } }

[schedules.daily-report]
queue = "generate-report"
cron = "0 6 * * *"              # standard 5-field cron, in `timezone` (default UTC)
payload = { kind = "daily" }
catch_up = "latest"             # latest | all | none: fires missed while the daemon was down

[store]
backend = "postgres"           # "sqlite" (the default, in data_dir) | "sled" | "postgres"
url = { env = "KHATA_DATABASE_URL" }   # or a string, or { file = "/etc/khata/db-url" }
pool = 16
lease = "30s"                  # a lease not renewed by heartbeat for this long expires
heartbeat = "5s"
"#;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("/etc/khata/jobs.toml"))
}

fn errors(text: &str) -> Vec<ConfigIssue> {
    match parse(text) {
        Ok(config) => panic!("expected errors, got {config:#?}"),
        Err(e) => e.errors,
    }
}

fn issue<'a>(issues: &'a [ConfigIssue], key: &str) -> &'a ConfigIssue {
    issues
        .iter()
        .find(|i| i.key == key)
        .unwrap_or_else(|| panic!("no issue for {key}: {issues:#?}"))
}

#[test]
fn retention_windows_and_kv_namespaces() {
    let config = parse(
        r#"
[retention]
dead = "90d"
tombstones = "1d"
kv = { users = "12h" }
[queues.a]
plugin = "p"
namespace = "users"
"#,
    )
    .unwrap();
    let r = &config.retention;
    assert_eq!(r.jobs, Duration::from_secs(7 * 86_400), "default kept");
    assert_eq!(r.dead, Duration::from_secs(90 * 86_400));
    assert_eq!(r.tombstones, Duration::from_secs(86_400));
    assert_eq!(r.kv["users"], Duration::from_secs(12 * 3600));

    let issues = errors(
        "[retention]\nkv = { userz = \"1h\", users = \"0s\" }\n[queues.a]\nplugin = \"p\"\nnamespace = \"users\"\n",
    );
    let typo = issue(&issues, "retention.kv.userz");
    assert_eq!((typo.line, typo.column), (Some(2), Some(8)));
    assert!(
        typo.message.contains("\"userz\"") && typo.message.contains("users"),
        "{typo:?}"
    );
    assert!(
        issue(&issues, "retention.kv.users")
            .message
            .contains("longer than zero")
    );
}

#[test]
fn design_example_parses() {
    let config = parse(FULL_EXAMPLE).unwrap();
    assert_eq!(config.path, Path::new("/etc/khata/jobs.toml"));
    assert_eq!(config.daemon.data_dir, Path::new("/etc/khata/data"));
    assert_eq!(config.daemon.plugins_dir, Path::new("/etc/khata/plugins"));
    assert_eq!(config.daemon.listen, "127.0.0.1:7373".parse().unwrap());
    assert_eq!(config.daemon.token, None);
    assert_eq!(config.daemon.shutdown_grace, Duration::from_secs(30));
    assert_eq!(config.retention, Retention::default());
    assert_eq!(config.retention.jobs, Duration::from_secs(7 * 86_400));

    let names: Vec<&str> = config.queues.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "charge-customer",
            "generate-report",
            "update-search-index",
            "welcome-email"
        ]
    );
    let welcome = config.queue("welcome-email").unwrap();
    assert_eq!(welcome.plugin, "welcome_email");
    assert_eq!(welcome.namespace, "users");
    assert_eq!(
        welcome.grants,
        Grants {
            kv: true,
            email: true,
            index: vec![],
            http: vec![],
            everything: false,
        }
    );
    assert_eq!(welcome.concurrency, 4);
    assert_eq!(welcome.timeout, Duration::from_secs(30));
    assert_eq!(welcome.max_attempts, 5);
    assert_eq!(welcome.backoff, Backoff::default());
    assert_eq!(welcome.memory, 64 * MIB);
    assert_eq!(welcome.on_uncertain, OnUncertain::Skip);
    assert_eq!(welcome.rate_limit, None);
    assert_eq!(welcome.max_payload, MIB);
    assert_eq!(welcome.max_result, MIB);

    let charge = &config.queues["charge-customer"];
    assert_eq!(charge.namespace, "charge-customer");
    assert_eq!(charge.grants.http, ["payments"]);
    assert!(!charge.grants.kv && !charge.grants.email);
    let index = &config.queues["update-search-index"];
    assert_eq!(index.grants.index, ["products"]);

    assert_eq!(config.email.transport, EmailTransport::Outbox);
    assert_eq!(config.email.from, "noreply@example.com");
    assert_eq!(config.email.host, "127.0.0.1");
    assert_eq!(config.email.port, 25);
    assert_eq!(config.email.tls, SmtpTls::None);
    assert_eq!(config.email.timeout, Duration::from_secs(10));

    let payments = &config.http["payments"];
    assert_eq!(payments.name, "payments");
    assert_eq!(payments.base_url, "http://127.0.0.1:12111");
    assert_eq!(
        payments.idempotency_header.as_deref(),
        Some("Idempotency-Key")
    );
    assert_eq!(payments.timeout, Duration::from_secs(10));
    assert_eq!(payments.max_response, MIB);
    assert_eq!(payments.reconcile, None);
    assert_eq!(
        payments.headers["Authorization"],
        Secret::Env {
            var: "PAYMENTS_TOKEN".into(),
            prefix: "Bearer ".into()
        }
    );

    let report = &config.schedules["daily-report"];
    assert_eq!(report.queue, "generate-report");
    assert_eq!(report.cron, "0 6 * * *");
    assert_eq!(report.timezone, "UTC");
    assert_eq!(report.payload, serde_json::json!({"kind": "daily"}));
    assert_eq!(report.catch_up, CatchUp::Latest);

    assert_eq!(config.store.backend, Backend::Postgres);
    assert_eq!(
        config.store.url,
        Some(Secret::Env {
            var: "KHATA_DATABASE_URL".into(),
            prefix: String::new()
        })
    );
    assert_eq!(config.store.pool, 16);
    assert_eq!(config.store.lease, Duration::from_secs(30));
    assert_eq!(config.store.heartbeat, Duration::from_secs(5));
}

#[test]
fn empty_file_is_all_defaults() {
    let config = parse("").unwrap();
    assert!(config.queues.is_empty());
    assert_eq!(config.daemon.data_dir, Path::new("/etc/khata/data"));
    assert_eq!(config.daemon.listen, Daemon::default().listen);
    assert_eq!(config.retention, Retention::default());
    assert_eq!(config.email, Email::default());
    assert_eq!(config.store, StoreConfig::default());
    assert!(config.http.is_empty() && config.schedules.is_empty());
}

#[test]
fn defaults_applied_and_overridden() {
    let config = parse(
        r#"
[defaults]
concurrency = 8
timeout = "1m"
backoff = { initial = "2s", jitter = 0.0 }
rate_limit = { max = 100, per = "1s" }
max_payload = "512KiB"

[queues.plain]
plugin = "echo"

[queues.tuned]
plugin = "echo"
concurrency = 1
timeout = "500ms"
max_attempts = 10
backoff = { multiplier = 3 }
memory = 1048576
on_uncertain = "dead"
rate_limit = { max = 5, per = "1m" }
max_payload = "2MiB"
max_result = "4KiB"
"#,
    )
    .unwrap();
    let plain = &config.queues["plain"];
    assert_eq!(plain.namespace, "plain");
    assert_eq!(plain.grants, Grants::default());
    assert_eq!(plain.concurrency, 8);
    assert_eq!(plain.timeout, Duration::from_secs(60));
    assert_eq!(plain.max_attempts, 5);
    assert_eq!(
        plain.backoff,
        Backoff {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(600),
            multiplier: 2.0,
            jitter: 0.0
        }
    );
    assert_eq!(plain.memory, 64 * MIB);
    assert_eq!(plain.on_uncertain, OnUncertain::Skip);
    assert_eq!(
        plain.rate_limit,
        Some(RateLimit {
            max: 100,
            per: Duration::from_secs(1)
        })
    );
    assert_eq!(plain.max_payload, 512 * KIB);
    assert_eq!(plain.max_result, MIB);

    let tuned = &config.queues["tuned"];
    assert_eq!(tuned.concurrency, 1);
    assert_eq!(tuned.timeout, Duration::from_millis(500));
    assert_eq!(tuned.max_attempts, 10);
    // Only the multiplier is the queue's own; the rest come from [defaults].
    assert_eq!(
        tuned.backoff,
        Backoff {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(600),
            multiplier: 3.0,
            jitter: 0.0
        }
    );
    assert_eq!(tuned.memory, MIB);
    assert_eq!(tuned.on_uncertain, OnUncertain::Dead);
    assert_eq!(
        tuned.rate_limit,
        Some(RateLimit {
            max: 5,
            per: Duration::from_secs(60)
        })
    );
    assert_eq!(tuned.max_payload, 2 * MIB);
    assert_eq!(tuned.max_result, 4 * KIB);
}

#[test]
fn unknown_key_in_queue_has_line_and_column() {
    let text = "[queues.x]\nplugin = \"echo\"\n  bogus = 1\n";
    let issues = errors(text);
    assert_eq!(issues.len(), 1, "{issues:#?}");
    let e = &issues[0];
    assert_eq!(e.key, "queues.x.bogus");
    assert_eq!((e.line, e.column), (Some(3), Some(3)));
    assert!(e.message.contains("unknown field `bogus`"), "{}", e.message);

    // In an inline table, and in a grant.
    let e = &errors("[queues.x]\nplugin = \"echo\"\ngrants = { kv = true, disk = true }\n")[0];
    assert_eq!(e.key, "queues.x.grants.disk");
    assert_eq!((e.line, e.column), (Some(3), Some(23)));

    // At the top level.
    let e = &errors("[deamon]\n")[0];
    assert_eq!(e.key, "deamon");
    assert_eq!((e.line, e.column), (Some(1), Some(2)));
}

#[test]
fn wrong_type_names_key_and_position() {
    let e = &errors("[queues.x]\nplugin = \"echo\"\nconcurrency = \"4\"\n")[0];
    assert_eq!(e.key, "queues.x.concurrency");
    assert_eq!((e.line, e.column), (Some(3), Some(15)));

    let e = &errors("[queues.x]\nplugin = \"echo\"\ngrants = { index = [\"a\", 3] }\n")[0];
    assert_eq!(e.key, "queues.x.grants.index[1]");
    assert_eq!((e.line, e.column), (Some(3), Some(26)));

    let e = &errors("[http.p]\nbase_url = \"http://x\"\nheaders = { A = 5 }\n")[0];
    assert_eq!(e.key, "http.p.headers.A");

    let e = &errors(
        "[http.p]\nbase_url = \"http://x\"\nheaders = { A = { env = \"X\", pre = \"Bearer \" } }\n",
    )[0];
    assert_eq!(e.key, "http.p.headers.A.pre");
    assert_eq!((e.line, e.column), (Some(3), Some(30)));
}

#[test]
fn syntax_error_has_position() {
    let e = &errors("[daemon]\nlisten = \"127.0.0.1:7373\ndata_dir = \"x\"\n")[0];
    assert_eq!(e.line, Some(2));
    assert!(e.column.is_some());
}

#[test]
fn bad_duration_names_key_and_position() {
    let text = "\n[queues.welcome]\nplugin = \"welcome_email\"\ntimeout = \"30 parsecs\"\n";
    let err = parse(text).unwrap_err();
    assert_eq!(err.errors.len(), 1, "{err}");
    let e = &err.errors[0];
    assert_eq!(e.key, "queues.welcome.timeout");
    assert_eq!((e.line, e.column), (Some(4), Some(11)));
    let shown = err.to_string();
    assert!(
        shown.starts_with(
            "/etc/khata/jobs.toml:4:11: queues.welcome.timeout: invalid duration \"30 parsecs\": "
        ),
        "{shown}"
    );
    let relative = Config::parse(text, Path::new("jobs.toml")).unwrap_err();
    assert!(
        relative
            .to_string()
            .starts_with("jobs.toml:4:11: queues.welcome.timeout: ")
    );
}

#[test]
fn semantic_errors_are_all_reported() {
    let text = r#"
[defaults]
concurrency = 0
backoff = { multiplier = 0.5, jitter = 1.5 }

[queues."bad name"]
plugin = "echo"

[queues.a]
plugin = "echo"
max_attempts = 0
memory = "lots"
on_uncertain = "maybe"
grants = { http = ["payments", "nowhere"] }

[queues.b]
namespace = "b"

[http.payments]
base_url = "ftp://example.com"

[schedules.s]
queue = "missing"
cron = "0 6 * *"
catch_up = "sometimes"

[store]
backend = "mysql"
lease = "5s"
heartbeat = "10s"
"#;
    let err = parse(text).unwrap_err();
    let issues = &err.errors;
    let expect = [
        ("defaults.concurrency", 3, 15),
        ("defaults.backoff.multiplier", 4, 26),
        ("defaults.backoff.jitter", 4, 40),
        ("queues.\"bad name\"", 6, 9),
        ("queues.a.max_attempts", 11, 16),
        ("queues.a.memory", 12, 10),
        ("queues.a.on_uncertain", 13, 16),
        ("queues.a.grants.http[1]", 14, 32),
        ("queues.b.plugin", 16, 9),
        ("http.payments.base_url", 20, 12),
        ("schedules.s.queue", 23, 9),
        ("schedules.s.cron", 24, 8),
        ("schedules.s.catch_up", 25, 12),
        ("store.backend", 28, 11),
        ("store.heartbeat", 30, 13),
    ];
    for (key, line, column) in expect {
        let found = issue(issues, key);
        assert_eq!(
            (found.line, found.column),
            (Some(line), Some(column)),
            "{key}: {found:?}"
        );
    }
    assert_eq!(issues.len(), expect.len(), "{err}");
    // Sorted by position, one line each.
    assert_eq!(err.to_string().lines().count(), expect.len());
    assert!(issues.windows(2).all(|w| w[0].line <= w[1].line));
}

#[test]
fn relative_paths_resolve_against_the_config_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("secrets")).unwrap();
    std::fs::write(
        dir.path().join("secrets/token"),
        "  s3cret-s3cret-s3cret \n",
    )
    .unwrap();
    std::fs::write(dir.path().join("secrets/db"), "postgres://x\n").unwrap();
    let text = r#"
[daemon]
data_dir = "state"
plugins_dir = "/opt/khata/plugins"
token_file = "secrets/token"

[store]
backend = "postgres"
url = { file = "./secrets/db" }
"#;
    let path = dir.path().join("jobs.toml");
    std::fs::write(&path, text).unwrap();
    let config = Config::load(&path).unwrap();
    assert_eq!(config.daemon.data_dir, dir.path().join("state"));
    assert_eq!(config.daemon.plugins_dir, Path::new("/opt/khata/plugins"));
    assert_eq!(config.daemon.token.as_deref(), Some("s3cret-s3cret-s3cret"));
    let url = config.store.url.clone().unwrap();
    assert_eq!(
        url,
        Secret::File {
            path: dir.path().join("secrets/db"),
            prefix: String::new()
        }
    );
    assert_eq!(url.resolve().unwrap(), "postgres://x");
    assert!(!format!("{config:?}").contains("s3cret"));

    // A bare file name: relative to the working directory, as given.
    let config = Config::parse("", Path::new("jobs.toml")).unwrap();
    assert_eq!(config.daemon.data_dir, Path::new("data"));
    assert_eq!(config.daemon.plugins_dir, Path::new("plugins"));
}

#[test]
fn token_file_problems_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jobs.toml");
    let text = "[daemon]\nlisten = \"0.0.0.0:7373\"\ntoken_file = \"nope\"\n";
    let err = Config::parse(text, &path).unwrap_err();
    assert_eq!(err.errors.len(), 1, "{err}");
    let e = &err.errors[0];
    assert_eq!(e.key, "daemon.token_file");
    assert_eq!((e.line, e.column), (Some(3), Some(14)));
    assert!(e.message.contains("nope"), "{}", e.message);

    let err = parse("[daemon]\ntoken = \"a\"\ntoken_file = \"b\"\n").unwrap_err();
    assert_eq!(err.errors[0].key, "daemon.token_file");
}

#[test]
fn a_short_token_and_a_bad_host_name_are_named() {
    let e = &errors("[daemon]\ntoken = \"s3cret\"\n")[0];
    assert_eq!(e.key, "daemon.token");
    assert_eq!((e.line, e.column), (Some(2), Some(9)));
    assert!(
        e.message.contains("6 bytes") && e.message.contains("16"),
        "{}",
        e.message
    );

    let e = &errors("[daemon]\nallowed_hosts = [\"jobs.internal\", \"x:80\"]\n")[0];
    assert_eq!(e.key, "daemon.allowed_hosts");
    assert_eq!((e.line, e.column), (Some(2), Some(17)));
    assert!(e.message.contains("\"x:80\""), "{}", e.message);
    let config = parse("[daemon]\nallowed_hosts = [\"Jobs.Internal\"]\n").unwrap();
    assert_eq!(config.daemon.allowed_hosts, ["jobs.internal"]);
}

#[test]
fn non_loopback_listen_needs_a_token() {
    let e = &errors("[daemon]\nlisten = \"0.0.0.0:7373\"\n")[0];
    assert_eq!(e.key, "daemon.listen");
    assert_eq!((e.line, e.column), (Some(2), Some(10)));
    assert!(e.message.contains("token"), "{}", e.message);

    let config =
        parse("[daemon]\nlisten = \"0.0.0.0:7373\"\ntoken = \"0123456789abcdef\"\n").unwrap();
    assert_eq!(config.daemon.token.as_deref(), Some("0123456789abcdef"));
    assert_eq!(config.daemon.listen.port(), 7373);
    parse("[daemon]\nlisten = \"[::1]:8080\"\n").unwrap();

    let e = &errors("[daemon]\nlisten = \"localhost\"\n")[0];
    assert_eq!(e.key, "daemon.listen");
}

#[test]
fn missing_plugin_and_several_sections_checked() {
    let issues = errors(
        r#"
[queues.q]
plugin = "../evil"
namespace = "a.b"

[email]
transport = "smtp"
from = "nobody"
port = 70000
username = "u"

[http.p]
base_url = "https://api.example.com/"
idempotency_header = "Idem Key"
headers = { "X Bad" = "v", X-Env = { prefix = "p" } }
reconcile = { method = "G3T", path = "v1" }
max_response = 0
"#,
    );
    for key in [
        "queues.q.plugin",
        "queues.q.namespace",
        "email.from",
        "email.port",
        "email.password",
        "http.p.idempotency_header",
        "http.p.headers.\"X Bad\"",
        "http.p.headers.X-Env",
        "http.p.reconcile.method",
        "http.p.reconcile.path",
        "http.p.max_response",
    ] {
        issue(&issues, key);
    }
}

#[test]
fn smtp_http_and_store_values() {
    let config = parse(
        r#"
[email]
transport = "smtp"
host = "mail.example.com"
port = 2525
tls = "starttls"
username = "khata"
password = { file = "/etc/khata/smtp", prefix = "" }
timeout = "3s"

[http.push]
base_url = "https://push.example.com/api/"
headers = { X-Plain = "value", X-File = { file = "push-key" } }
max_response = 4096
reconcile = { method = "get", path = "/v1/messages" }

[store]
backend = "sled"
pool = 2
cache = "32MiB"
"#,
    )
    .unwrap();
    assert_eq!(config.email.transport, EmailTransport::Smtp);
    assert_eq!(config.email.port, 2525);
    assert_eq!(config.email.tls, SmtpTls::Starttls);
    assert_eq!(config.email.username, Some(Secret::Plain("khata".into())));
    assert_eq!(config.email.timeout, Duration::from_secs(3));
    let push = &config.http["push"];
    assert_eq!(push.base_url, "https://push.example.com/api");
    assert_eq!(push.headers["X-Plain"], Secret::Plain("value".into()));
    assert_eq!(
        push.headers["X-File"],
        Secret::File {
            path: "/etc/khata/push-key".into(),
            prefix: String::new()
        }
    );
    assert_eq!(push.max_response, 4096);
    assert_eq!(
        push.reconcile,
        Some(Reconcile {
            method: "GET".into(),
            path: "/v1/messages".into()
        })
    );
    assert_eq!(config.store.backend, Backend::Sled);
    assert_eq!(config.store.pool, 2);
    assert_eq!(config.store.cache, 32 * MIB);
    assert!(!format!("{:?}", config.email).contains("\"khata\""));
}

#[test]
fn store_cache_only_with_sled_and_at_least_a_mebibyte() {
    assert_eq!(parse("").unwrap().store.cache, SLED_CACHE);
    let issues = errors("[store]\ncache = \"64MiB\"\n");
    let found = issue(&issues, "store.cache");
    assert_eq!((found.line, found.column), (Some(2), Some(9)), "{found:?}");
    assert!(
        found.message.contains("only used by backend \"sled\""),
        "{found:?}"
    );
    let issues = errors("[store]\nbackend = \"sled\"\ncache = \"12KiB\"\n");
    assert_eq!(issue(&issues, "store.cache").line, Some(3));
}

#[test]
fn store_url_only_with_postgres() {
    let issues = errors("[store]\nbackend = \"postgres\"\n");
    assert_eq!(issue(&issues, "store.url").line, Some(2));
    let issues = errors("[store]\nurl = \"postgres://x\"\n");
    assert_eq!(issue(&issues, "store.url").line, Some(2));
}

#[test]
fn an_inline_store_url_is_checked_without_being_repeated() {
    let issues = errors(
        "[store]\nbackend = \"postgres\"\npool = 4\nurl = \"postgres://u:s3cret@db:port/khata\"\n",
    );
    let found = issue(&issues, "store.url");
    assert_eq!((found.line, found.column), (Some(4), Some(7)), "{found:?}");
    assert!(
        found.message.contains("not a PostgreSQL connection URL"),
        "{found:?}"
    );
    assert!(!found.message.contains("s3cret"), "{found:?}");
    let issues = errors("[store]\nbackend = \"postgres\"\nurl = \"postgres://db\"\npool = 0\n");
    let found = issue(&issues, "store.pool");
    assert_eq!((found.line, found.column), (Some(4), Some(8)), "{found:?}");
    let config = parse(
        "[store]\nbackend = \"postgres\"\nurl = { env = \"KHATA_DATABASE_URL\" }\npool = 4\n",
    )
    .unwrap();
    assert_eq!(config.store.pool, 4);
}

#[test]
fn schedule_payload_becomes_json() {
    let config = parse(
        r#"
[queues.r]
plugin = "generate_report"

[schedules.weekly]
queue = "r"
cron = "0  6 * *   1"
timezone = "Europe/Berlin"
payload = { period = "week", n = 2, ratio = 0.5, tags = ["a", "b"], at = 1979-05-27T07:32:00Z, nested = { ok = true } }
catch_up = "all"

[schedules.bare]
queue = "r"
cron = "*/5 * * * *"
"#,
    )
    .unwrap();
    let weekly = &config.schedules["weekly"];
    assert_eq!(weekly.cron, "0 6 * * 1");
    assert_eq!(weekly.timezone, "Europe/Berlin");
    assert_eq!(weekly.catch_up, CatchUp::All);
    assert_eq!(
        weekly.payload,
        serde_json::json!({
            "period": "week", "n": 2, "ratio": 0.5, "tags": ["a", "b"],
            "at": "1979-05-27T07:32:00Z", "nested": {"ok": true}
        })
    );
    let bare = &config.schedules["bare"];
    assert_eq!(bare.payload, serde_json::json!({}));
    assert_eq!(bare.catch_up, CatchUp::Latest);
    assert_eq!(bare.timezone, "UTC");

    let issues = errors(
        "[queues.r]\nplugin = \"x\"\n[schedules.s]\nqueue = \"r\"\ncron = \"* * * * *\"\npayload = { x = nan }\n",
    );
    assert_eq!(issue(&issues, "schedules.s.payload").line, Some(6));
}

#[test]
fn backoff_cannot_start_above_its_max() {
    let issues = errors("[defaults]\nbackoff = { initial = \"20m\" }\n");
    assert_eq!(issue(&issues, "defaults.backoff.initial").line, Some(2));
    let issues = errors(
        "[defaults]\nbackoff = { max = \"1h\" }\n[queues.q]\nplugin = \"x\"\nbackoff = { max = \"1s\", initial = \"5s\" }\n",
    );
    assert_eq!(issues.len(), 1);
    assert_eq!(issue(&issues, "queues.q.backoff.max").line, Some(5));
}

#[test]
fn backoff_delay() {
    let b = Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(60),
        multiplier: 2.0,
        jitter: 0.0,
    };
    assert_eq!(b.delay(1, 0.3), Duration::from_secs(1));
    assert_eq!(b.delay(0, 0.3), Duration::from_secs(1));
    assert_eq!(b.delay(2, 0.3), Duration::from_secs(2));
    assert_eq!(b.delay(3, 0.3), Duration::from_secs(4));
    assert_eq!(b.delay(6, 0.3), Duration::from_secs(32));
    assert_eq!(b.delay(7, 0.3), Duration::from_secs(60));
    assert_eq!(b.delay(1000, 0.3), Duration::from_secs(60));
    assert_eq!(b.delay(u32::MAX, 0.3), Duration::from_secs(60));

    let j = Backoff {
        jitter: 0.2,
        ..b.clone()
    };
    let close = |d: Duration, secs: f64| (d.as_secs_f64() - secs).abs() < 1e-9;
    assert!(close(j.delay(1, 0.5), 1.0));
    assert!(close(j.delay(1, 0.0), 0.8));
    assert!(close(j.delay(3, 0.75), 4.0 * 1.1));
    assert!(close(j.delay(100, 0.0), 48.0));
    for i in 0..100 {
        let u = f64::from(i) / 100.0;
        for attempt in [1, 2, 5, 10, 50] {
            let d = j.delay(attempt, u).as_secs_f64();
            let base = b.delay(attempt, u).as_secs_f64();
            assert!(d >= base * 0.8 - 1e-9 && d <= base * 1.2 + 1e-9);
            assert!(d <= 60.0 * 1.2 + 1e-9);
        }
    }
    // Out-of-range randomness is clamped, never negative or above the bound.
    assert!(close(j.delay(100, 7.0), 72.0));
    assert!(close(j.delay(100, -3.0), 48.0));
    let full = Backoff {
        jitter: 1.0,
        ..b.clone()
    };
    assert_eq!(full.delay(3, 0.0), Duration::ZERO);
    assert_eq!(full.delay(100, 0.999_999_999_9).as_secs(), 119);
    assert!(full.delay(100, f64::NAN) <= Duration::from_secs(120));
}

#[test]
fn secrets_resolve() {
    let path = std::env::var("PATH").unwrap_or_default();
    let secret = Secret::Env {
        var: "PATH".into(),
        prefix: "p:".into(),
    };
    if !path.is_empty() {
        assert_eq!(secret.resolve().unwrap(), format!("p:{path}"));
    }
    let missing = Secret::Env {
        var: "KHATA_TEST_SURELY_UNSET_7f3a".into(),
        prefix: String::new(),
    };
    assert!(
        missing
            .resolve()
            .unwrap_err()
            .contains("KHATA_TEST_SURELY_UNSET_7f3a")
    );
    let file = Secret::File {
        path: "/nonexistent/khata/secret".into(),
        prefix: String::new(),
    };
    assert!(
        file.resolve()
            .unwrap_err()
            .contains("/nonexistent/khata/secret")
    );
    assert_eq!(Secret::Plain("x".into()).resolve().unwrap(), "x");
    assert_eq!(
        format!("{:?}", Secret::Plain("x".into())),
        "Plain(<redacted>)"
    );
}

#[test]
fn load_reports_unreadable_file() {
    let err = Config::load(Path::new("/nonexistent/khata/jobs.toml")).unwrap_err();
    assert_eq!(err.errors.len(), 1);
    assert!(
        err.to_string()
            .starts_with("/nonexistent/khata/jobs.toml: cannot read")
    );
}
