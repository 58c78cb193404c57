use super::*;
use clap::error::ErrorKind;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("khata").chain(args.iter().copied()))
}

#[test]
fn the_command_definition_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn serve_and_check_take_a_config_path() {
    let cli = parse(&["serve", "-c", "/etc/khata/jobs.toml"]).unwrap();
    assert!(matches!(cli.command, Command::Serve));
    assert_eq!(
        cli.global.config_path(),
        PathBuf::from("/etc/khata/jobs.toml")
    );

    let cli = parse(&["--config", "x.toml", "check"]).unwrap();
    assert!(matches!(cli.command, Command::Check));
    assert_eq!(cli.global.config_path(), PathBuf::from("x.toml"));

    let cli = parse(&["check"]).unwrap();
    assert_eq!(cli.global.config_path(), PathBuf::from("jobs.toml"));

    let cli = parse(&["store", "migrate", "-c", "x.toml"]).unwrap();
    assert!(matches!(
        cli.command,
        Command::Store {
            command: StoreCommand::Migrate
        }
    ));
    assert_eq!(cli.global.config_path(), PathBuf::from("x.toml"));
    assert!(parse(&["store"]).is_err(), "a store subcommand is required");
}

#[test]
fn store_copy_takes_one_source_and_one_target() {
    use crate::daemon::LedgerAt;
    let cli = parse(&["store", "copy", "--from", "data", "--to-env", "PG_URL"]).unwrap();
    let Command::Store {
        command: StoreCommand::Copy(args),
    } = cli.command
    else {
        panic!("not store copy: {:?}", cli.command);
    };
    assert_eq!(args.page, 500);
    assert_eq!(
        LedgerAt::parse(args.from.as_deref().unwrap(), "--from"),
        LedgerAt::DataDir(PathBuf::from("data"))
    );
    assert_eq!(args.to_env.as_deref(), Some("PG_URL"));
    assert!(matches!(
        LedgerAt::parse("postgres://u:p@h/db", "--to"),
        LedgerAt::Postgres { named, .. } if named == "the URL of --to"
    ));
    assert_eq!(
        LedgerAt::parse("/etc/khata/jobs.toml", "--to"),
        LedgerAt::Config(PathBuf::from("/etc/khata/jobs.toml"))
    );
    for bad in [
        &["store", "copy", "--from", "a"][..],
        &["store", "copy", "--to", "b"],
        &[
            "store",
            "copy",
            "--from",
            "a",
            "--from-env",
            "X",
            "--to",
            "b",
        ],
        &["store", "copy", "--from", "a", "--to", "b", "--page", "0"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?} is a usage error");
    }
}

#[test]
fn enqueue_with_every_option() {
    let cli = parse(&[
        "enqueue",
        "welcome-email",
        r#"{"user_id": 42}"#,
        "--id",
        "job-1",
        "--dedup-key",
        "user-42",
        "--dedup-for",
        "10m",
        "--delay",
        "30s",
        "--priority",
        "-3",
        "--max-attempts",
        "7",
        "--json",
        "--url",
        "http://example:1",
    ])
    .unwrap();
    let Command::Enqueue(args) = cli.command else {
        panic!("not enqueue: {:?}", cli.command)
    };
    assert_eq!(args.queue, "welcome-email");
    assert!(args.output.json);
    assert_eq!(cli.global.url.as_deref(), Some("http://example:1"));
    let payload = match args.payload.clone() {
        PayloadArg::Json(v) => v,
        PayloadArg::Stdin => panic!("stdin"),
    };
    let body = serde_json::to_value(args.request(payload)).unwrap();
    assert_eq!(
        body,
        json!({
            "payload": {"user_id": 42},
            "id": "job-1",
            "dedup_key": "user-42",
            "dedup_for": "10m",
            "delay": "30s",
            "priority": -3,
            "max_attempts": 7,
        })
    );
}

#[test]
fn enqueue_payload_defaults_to_an_empty_object_and_dash_means_stdin() {
    let Command::Enqueue(args) = parse(&["enqueue", "q"]).unwrap().command else {
        panic!()
    };
    assert_eq!(args.payload, PayloadArg::Json(JsonText::default()));
    let body = serde_json::to_value(args.request(JsonText::default())).unwrap();
    assert_eq!(body, json!({"payload": {}}));

    let Command::Enqueue(args) = parse(&["enqueue", "q", "-"]).unwrap().command else {
        panic!()
    };
    assert_eq!(args.payload, PayloadArg::Stdin);
}

#[test]
fn enqueue_refuses_bad_arguments_as_usage_errors() {
    let err = parse(&["enqueue", "q", "{not json"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ValueValidation);
    assert_eq!(err.exit_code(), 2);
    let message = err.to_string();
    assert!(message.contains("PAYLOAD_JSON"), "{message}");
    assert!(message.contains("key must be a string"), "{message}");

    let err = parse(&["enqueue", "q", "--delay", "soon"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ValueValidation);

    let err = parse(&["enqueue", "q", "--dedup-for", "1m"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);

    let err = parse(&[
        "enqueue",
        "q",
        "--delay",
        "1m",
        "--run-at",
        "2030-01-01T00:00:00Z",
    ])
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ArgumentConflict);

    let err = parse(&["enqueue", "q", "--max-attempts", "0"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ValueValidation);

    let err = parse(&["enqueue"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn read_commands() {
    let cli = parse(&["job", "abc", "--json"]).unwrap();
    assert!(matches!(cli.command, Command::Job { ref id, output } if id == "abc" && output.json));

    let Command::Jobs(args) = parse(&[
        "jobs", "--queue", "q", "--state", "dead", "--limit", "5", "--cursor", "c1",
    ])
    .unwrap()
    .command
    else {
        panic!()
    };
    assert_eq!(args.queue.as_deref(), Some("q"));
    assert_eq!(args.state, Some(JobState::Dead));
    assert_eq!(args.limit, Some(5));
    assert_eq!(args.cursor.as_deref(), Some("c1"));
    assert!(!args.output.json);

    let err = parse(&["jobs", "--state", "sleeping"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidValue);

    assert!(matches!(
        parse(&["queues", "--json"]).unwrap().command,
        Command::Queues { output } if output.json
    ));

    let Command::Fences(args) = parse(&["fences", "--state", "uncertain", "--namespace", "users"])
        .unwrap()
        .command
    else {
        panic!()
    };
    assert_eq!(args.state, Some(FenceState::Uncertain));
    assert_eq!(args.namespace.as_deref(), Some("users"));
}

#[test]
fn write_commands() {
    assert!(matches!(
        parse(&["retry", "j1"]).unwrap().command,
        Command::Retry { ref id, .. } if id == "j1"
    ));
    assert!(matches!(
        parse(&["cancel", "j1"]).unwrap().command,
        Command::Cancel { ref id, .. } if id == "j1"
    ));

    let cli = parse(&[
        "fence",
        "resolve",
        "users",
        "email",
        "welcome:42",
        "not-done",
    ])
    .unwrap();
    let Command::Fence {
        command:
            FenceCommand::Resolve {
                namespace,
                kind,
                key,
                outcome,
            },
    } = cli.command
    else {
        panic!()
    };
    assert_eq!(
        (namespace.as_str(), kind.as_str(), key.as_str()),
        ("users", "email", "welcome:42")
    );
    assert_eq!(outcome, Resolution::NotDone);
    assert_eq!(outcome.as_str(), "not-done");

    let err = parse(&["fence", "resolve", "users", "email", "k", "maybe"]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidValue);
}

#[test]
fn help_and_version_exit_zero() {
    for args in [&["--help"][..], &["--version"], &["enqueue", "--help"]] {
        let err = parse(args).unwrap_err();
        assert_eq!(err.exit_code(), 0, "{args:?}");
    }
    let err = parse(&[]).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    let err = parse(&["frobnicate"]).unwrap_err();
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn an_explicit_url_wins_and_skips_the_config() {
    let endpoint = resolve_endpoint(
        Some("http://10.0.0.1:9000"),
        Some("t0k"),
        Some(Path::new("/does/not/exist.toml")),
    )
    .unwrap();
    assert_eq!(
        endpoint,
        Endpoint {
            url: "http://10.0.0.1:9000".to_owned(),
            token: Some("t0k".to_owned())
        }
    );
}

#[test]
fn the_config_gives_url_and_token_file_relative_to_itself() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("secrets")).unwrap();
    std::fs::write(dir.path().join("secrets/token"), "s3cret\n").unwrap();
    let config = dir.path().join("jobs.toml");
    std::fs::write(
        &config,
        r#"
[daemon]
data_dir = "./data"
listen = "127.0.0.1:8080"
token_file = "secrets/token"

[queues.echo]
plugin = "echo"
"#,
    )
    .unwrap();
    let endpoint = resolve_endpoint(None, None, Some(&config)).unwrap();
    assert_eq!(endpoint.url, "http://127.0.0.1:8080");
    assert_eq!(endpoint.token.as_deref(), Some("s3cret"));

    // --token overrides the file's token but keeps its URL.
    let endpoint = resolve_endpoint(None, Some("other"), Some(&config)).unwrap();
    assert_eq!(endpoint.url, "http://127.0.0.1:8080");
    assert_eq!(endpoint.token.as_deref(), Some("other"));
}

#[test]
fn the_config_may_give_a_token_inline_and_a_wildcard_listen() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("khata.toml");
    std::fs::write(
        &config,
        "[daemon]\nlisten = \"0.0.0.0:7000\"\ntoken = \"inline\"\n",
    )
    .unwrap();
    let endpoint = resolve_endpoint(None, None, Some(&config)).unwrap();
    assert_eq!(endpoint.url, "http://127.0.0.1:7000");
    assert_eq!(endpoint.token.as_deref(), Some("inline"));

    assert_eq!(url_from_listen("[::]:7373"), "http://[::1]:7373");
    assert_eq!(url_from_listen("localhost:7373"), "http://localhost:7373");
    assert_eq!(url_from_listen("http://h:1/x"), "http://h:1/x");
}

#[test]
fn a_config_without_daemon_section_means_the_default_url() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("jobs.toml");
    std::fs::write(&config, "[queues.echo]\nplugin = \"echo\"\n").unwrap();
    let endpoint = resolve_endpoint(None, None, Some(&config)).unwrap();
    assert_eq!(
        endpoint,
        Endpoint {
            url: DEFAULT_URL.to_owned(),
            token: None
        }
    );
}

#[test]
fn a_named_config_must_be_readable_and_valid() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let err = resolve_endpoint(None, None, Some(&missing)).unwrap_err();
    assert!(format!("{err:#}").contains("missing.toml"), "{err:#}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[daemon\n").unwrap();
    let err = resolve_endpoint(None, None, Some(&bad)).unwrap_err();
    assert!(format!("{err:#}").contains("bad.toml"), "{err:#}");

    let no_token = dir.path().join("no-token.toml");
    std::fs::write(&no_token, "[daemon]\ntoken_file = \"nope\"\n").unwrap();
    let err = resolve_endpoint(None, None, Some(&no_token)).unwrap_err();
    assert!(format!("{err:#}").contains("nope"), "{err:#}");
}

#[test]
fn client_urls_keep_a_prefix_and_encode_segments() {
    let client = Client::new("http://h:1/khata/", None).unwrap();
    assert_eq!(
        client.url(&["v1", "jobs", "a/b c"]).as_str(),
        "http://h:1/khata/v1/jobs/a%2Fb%20c"
    );
    let client = Client::new("127.0.0.1:7373", None).unwrap();
    assert_eq!(
        client.url(&["v1", "queues"]).as_str(),
        "http://127.0.0.1:7373/v1/queues"
    );
    assert!(matches!(
        Client::new("https://h", None),
        Err(ClientError::BadUrl { .. })
    ));
    assert!(matches!(
        Client::new("http://", None),
        Err(ClientError::BadUrl { .. })
    ));
}

#[test]
fn api_errors_carry_the_servers_code_and_message() {
    let err = api_error(
        StatusCode::CONFLICT,
        br#"{"error": {"code": "id_reused", "message": "job j1 exists with another payload"}}"#,
    );
    assert_eq!(
        err.to_string(),
        "id_reused: job j1 exists with another payload"
    );
    let err = api_error(StatusCode::BAD_GATEWAY, b"<html>bad gateway</html>");
    assert_eq!(err.to_string(), "http_502: <html>bad gateway</html>");
    let err = api_error(StatusCode::SERVICE_UNAVAILABLE, b"");
    assert_eq!(err.to_string(), "http_503: Service Unavailable");
}

/// Serves one canned HTTP answer; returns the address and the request
/// as received.
async fn one_shot_server(
    status: &'static str,
    body: &'static str,
) -> (SocketAddr, tokio::task::JoinHandle<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        // Read the head, then as much body as Content-Length says.
        loop {
            let n = socket.read(&mut buf).await.unwrap();
            request.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&request).to_string();
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                if request.len() >= end + 4 + length {
                    break;
                }
            }
            if n == 0 {
                break;
            }
        }
        let answer = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(answer.as_bytes()).await.unwrap();
        String::from_utf8(request).unwrap()
    });
    (addr, task)
}

#[tokio::test]
async fn the_client_sends_the_token_and_the_body() {
    let (addr, server) = one_shot_server(
        "201 Created",
        r#"{"job": {"id": "j1", "state": "waiting"}, "deduplicated": false}"#,
    )
    .await;
    let client = Client::new(&format!("http://{addr}"), Some("t0k".into())).unwrap();
    let request = EnqueueRequest {
        payload: JsonText::parse(r#"{"a": 1}"#).unwrap(),
        dedup_key: Some("k".into()),
        ..Default::default()
    };
    let answer = client.enqueue("my queue", &request).await.unwrap();
    assert_eq!(answer["job"]["id"], "j1");
    let seen = server.await.unwrap();
    assert!(
        seen.starts_with("POST /v1/queues/my%20queue/jobs HTTP/1.1\r\n"),
        "{seen}"
    );
    assert!(
        seen.to_ascii_lowercase()
            .contains("authorization: bearer t0k\r\n"),
        "{seen}"
    );
    let body = &seen[seen.find("\r\n\r\n").unwrap() + 4..];
    assert_eq!(
        serde_json::from_str::<Value>(body).unwrap(),
        json!({"payload": {"a": 1}, "dedup_key": "k"})
    );
}

#[tokio::test]
async fn the_client_sends_queries_and_reports_api_errors() {
    let (addr, server) = one_shot_server(
        "404 Not Found",
        r#"{"error": {"code": "unknown_queue", "message": "no queue nope"}}"#,
    )
    .await;
    let client = Client::new(&format!("http://{addr}"), None).unwrap();
    let query = JobsQuery {
        queue: Some("nope".into()),
        state: Some("dead".into()),
        limit: Some(10),
        cursor: None,
    };
    let err = client.jobs(&query).await.unwrap_err();
    assert!(
        matches!(err, ClientError::Api { status, ref code, .. }
            if status == StatusCode::NOT_FOUND && code == "unknown_queue"),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "unknown_queue: no queue nope");
    let seen = server.await.unwrap();
    assert!(
        seen.starts_with("GET /v1/jobs?queue=nope&state=dead&limit=10 HTTP/1.1\r\n"),
        "{seen}"
    );
    assert!(
        !seen.to_ascii_lowercase().contains("authorization"),
        "{seen}"
    );
}

#[tokio::test]
async fn an_unreachable_daemon_is_named() {
    // Bind then drop, so the port is (very likely) closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let client = Client::new(&format!("http://{addr}"), None).unwrap();
    let err = client.queues().await.unwrap_err();
    assert!(matches!(err, ClientError::Unreachable { .. }), "{err:?}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

#[test]
fn human_output() {
    let job = json!({
        "id": "j1", "queue": "q", "state": "dead", "payload": {"a": 1},
        "priority": 0, "attempt": 2, "max_attempts": 2, "dedup_key": null,
        "run_at": "2030-01-01T00:00:00Z", "enqueued_at": "2030-01-01T00:00:00Z",
        "finished_at": null, "result": null, "last_error": "boom\nat line 2",
        "attempts": [
            {"number": 1, "started_at": "t1", "ended_at": "t2", "outcome": "retry", "error": "boom", "fencing_token": 7, "plugin_version": "0123456789abcdef"},
        ],
        "effects": [],
    });
    let out = render_job(&job);
    assert!(out.contains("state        dead\n"), "{out}");
    assert!(out.contains("attempt      2 of 2\n"), "{out}");
    assert!(
        out.contains("last error   boom\n             at line 2\n"),
        "{out}"
    );
    assert!(
        out.contains("  #  STARTED  ENDED  OUTCOME  TOKEN  VERSION       ERROR\n"),
        "{out}"
    );
    assert!(
        out.contains("  1  t1       t2     retry    7      0123456789ab  boom\n"),
        "{out}"
    );
    assert!(out.contains("effects: none\n"), "{out}");

    let queues = json!({"queues": [{
        "name": "echo", "plugin": "echo", "namespace": "echo",
        "version": "0123456789abcdef", "loaded_at": "t", "load_error": null,
        "counts": {"waiting": 1, "delayed": 0, "active": 0, "completed": 5, "dead": 0, "cancelled": 0},
    }]});
    let out = render_queues(&queues);
    assert_eq!(
        out,
        "NAME  PLUGIN  VERSION       WAITING  DELAYED  ACTIVE  COMPLETED  DEAD  CANCELLED\n\
         echo  echo    0123456789ab  1        0        0       5          0     0\n"
    );

    let page = json!({"jobs": [], "next_cursor": "c2"});
    assert_eq!(render_jobs(&page), "no jobs\nmore: --cursor c2\n");
}
