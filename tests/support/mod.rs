//! Runs the real `khata` binary on a real ledger in a temporary directory.
//!
//! Each test makes a [`Daemon`] from a jobs.toml fragment; the daemon gets a
//! free loopback port, its own data directory and the guest plugins built by
//! `scripts/build-plugins`. `kill9` and `start` let a test crash and restart it
//! on the same data.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub const KHATA: &str = env!("CARGO_BIN_EXE_khata");

/// Where `scripts/build-plugins` leaves the guests.
pub fn guest(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let path = root
        .join("target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is missing: build the guests first with scripts/build-plugins",
        path.display()
    );
    path
}

/// A reqwest client; the crate's reqwest takes its TLS provider from khata.
pub fn client() -> reqwest::Client {
    khata::effects::http::install_crypto_provider();
    reqwest::Client::new()
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub url: String,
    pub token: Option<String>,
    child: Option<Child>,
    pub http: reqwest::Client,
    envs: Vec<(String, String)>,
    /// The `[daemon]` section of jobs.toml, for `rewrite_config`.
    daemon_section: String,
}

impl Daemon {
    /// Writes jobs.toml (`[daemon]` is added) and plugins, without starting.
    pub fn prepare(queues_toml: &str, plugins: &[(&str, &str)]) -> Daemon {
        Self::prepare_with(queues_toml, plugins, "")
    }

    /// Like `prepare`, with extra `[daemon]` lines.
    pub fn prepare_with(queues_toml: &str, plugins: &[(&str, &str)], daemon_extra: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        std::fs::create_dir_all(dir.path().join("plugins")).expect("plugins dir");
        for (file, guest_name) in plugins {
            std::fs::copy(
                guest(guest_name),
                dir.path().join("plugins").join(format!("{file}.wasm")),
            )
            .expect("copy plugin");
        }
        let daemon_section = format!(
            "[daemon]\ndata_dir = \"data\"\nplugins_dir = \"plugins\"\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace = \"2s\"\n{daemon_extra}\n"
        );
        let config = format!("{daemon_section}{queues_toml}\n");
        std::fs::write(dir.path().join("jobs.toml"), config).expect("write jobs.toml");
        let token = daemon_extra
            .lines()
            .find_map(|l| l.strip_prefix("token = \""))
            .map(|t| t.trim_end_matches('"').to_owned());
        Daemon {
            dir,
            port,
            url: format!("http://127.0.0.1:{port}"),
            token,
            child: None,
            http: client(),
            envs: Vec::new(),
            daemon_section,
        }
    }

    /// Prepares and starts a daemon, waiting until it answers.
    pub async fn start_new(queues_toml: &str, plugins: &[(&str, &str)]) -> Daemon {
        let mut d = Self::prepare(queues_toml, plugins);
        d.start().await;
        d
    }

    /// Like `start_new`, with extra `[daemon]` lines.
    pub async fn start_new_with(
        queues_toml: &str,
        plugins: &[(&str, &str)],
        daemon_extra: &str,
    ) -> Daemon {
        let mut d = Self::prepare_with(queues_toml, plugins, daemon_extra);
        d.start().await;
        d
    }

    /// Sets an environment variable of the daemon process.
    pub fn env(&mut self, key: &str, value: &str) {
        self.envs.push((key.to_owned(), value.to_owned()));
    }

    /// Removes an environment variable set with `env`, for the next start.
    pub fn unset_env(&mut self, key: &str) {
        self.envs.retain(|(k, _)| k != key);
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("jobs.toml")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    /// Starts the daemon process and waits for `/healthz`.
    pub async fn start(&mut self) {
        self.start_within(Duration::from_secs(60)).await;
    }

    /// Like `start`, waiting up to `limit`: the daemon answers only once it
    /// has compiled its plugins, which for a big guest on a fresh data_dir
    /// (no compiled-code cache yet) takes a while.
    pub async fn start_within(&mut self, limit: Duration) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log file");
        let child = Command::new(KHATA)
            .args(["serve", "-c"])
            .arg(self.config_path())
            .env("KHATA_LOG", "info")
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn khata");
        self.child = Some(child);
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(r) = self.http.get(format!("{}/healthz", self.url)).send().await
                && r.status().is_success()
            {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "khata exited with {status} during start; log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "khata did not answer in {limit:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Writes jobs.toml again with the same `[daemon]` section and other
    /// queues (for a reload).
    pub fn rewrite_config(&self, queues_toml: &str) {
        std::fs::write(
            self.config_path(),
            format!("{}{queues_toml}\n", self.daemon_section),
        )
        .expect("write jobs.toml");
    }

    /// Sends SIGHUP: reload jobs.toml.
    pub fn hup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// `kill -9` the daemon and reap it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let status = Command::new("kill")
                .args(["-9", &c.id().to_string()])
                .status()
                .expect("kill");
            assert!(status.success());
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for the exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        let status = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
        c.wait().expect("wait")
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.url));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// Sends a request; returns the status and the JSON body.
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let post = method == reqwest::Method::POST;
        let mut r = self.req(method, path);
        match body {
            Some(b) => r = r.json(&b),
            // The API takes changes only as JSON (api/guard.rs).
            None if post => {
                r = r.header("content-type", "application/json");
            }
            None => {}
        }
        let resp = r.send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, v)
    }

    /// `GET /metrics`: the Prometheus text exposition.
    pub async fn metrics(&self) -> String {
        let (status, text) = self.call("GET", "/metrics", None).await;
        assert_eq!(status, 200, "{text}");
        match text {
            Value::String(text) => text,
            other => panic!("/metrics answered JSON: {other}"),
        }
    }

    /// Sends raw bytes as the body.
    pub async fn call_raw(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let resp = self
            .req(method, path)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Enqueues and returns the job id (asserting 201).
    pub async fn enqueue(&self, queue: &str, body: Value) -> String {
        let (status, v) = self
            .call("POST", &format!("/v1/queues/{queue}/jobs"), Some(body))
            .await;
        assert_eq!(status, 201, "enqueue answered {v}");
        v["job"]["id"].as_str().expect("job id").to_owned()
    }

    pub async fn job(&self, id: &str) -> Value {
        let (status, v) = self.call("GET", &format!("/v1/jobs/{id}"), None).await;
        assert_eq!(status, 200, "GET job {id}: {v}");
        v
    }

    /// Waits until the job is in `state` (or panics after `secs`).
    pub async fn wait_state(&self, id: &str, state: &str, secs: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let j = self.job(id).await;
            if j["state"] == state {
                return j;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} not {state} after {secs} s: {j}\nlog:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Runs a CLI command against this daemon.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = Command::new(KHATA);
        cmd.args(args)
            .env("KHATA_URL", &self.url)
            .env_remove("KHATA_TOKEN");
        if let Some(t) = &self.token {
            cmd.env("KHATA_TOKEN", t);
        }
        cmd.output().expect("run khata")
    }

    /// The queue entry of GET /v1/queues.
    pub async fn queue(&self, name: &str) -> Value {
        let (_, v) = self.call("GET", "/v1/queues", None).await;
        v["queues"]
            .as_array()
            .and_then(|qs| qs.iter().find(|q| q["name"] == name).cloned())
            .unwrap_or_else(|| panic!("no queue {name} in {v}"))
    }

    /// Waits until the queue entry of GET /v1/queues satisfies `ok`, and
    /// returns it (or panics after `secs`, saying `what`).
    pub async fn wait_queue(
        &self,
        queue: &str,
        what: &str,
        secs: u64,
        ok: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let q = self.queue(queue).await;
            if ok(&q) {
                return q;
            }
            assert!(
                Instant::now() < deadline,
                "queue {queue}: not {what} after {secs} s: {q}\nlog:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until the queue serves the plugin version `version` (short hash).
    pub async fn wait_version(&self, queue: &str, version: &str) -> Value {
        self.wait_queue(queue, &format!("on version {version}"), 30, |q| {
            q["version"] == version
        })
        .await
    }

    /// Where a plugin file of this daemon is.
    pub fn plugin_file(&self, file: &str) -> PathBuf {
        self.dir.path().join("plugins").join(format!("{file}.wasm"))
    }

    /// Replaces a plugin file the way deploy tools do: written beside it,
    /// then renamed over it (one atomic step).
    pub fn replace_plugin(&self, file: &str, bytes: &[u8]) {
        let tmp = self
            .dir
            .path()
            .join("plugins")
            .join(format!(".{file}.wasm.tmp"));
        std::fs::write(&tmp, bytes).expect("write temporary plugin");
        std::fs::rename(&tmp, self.plugin_file(file)).expect("rename plugin");
    }

    /// Overwrites a plugin file in place (truncate, then write), as `cp` does.
    pub fn overwrite_plugin(&self, file: &str, bytes: &[u8]) {
        std::fs::write(self.plugin_file(file), bytes).expect("overwrite plugin");
    }

    /// The output of `khata queues`, asserting success.
    pub fn cli_queues(&self) -> String {
        let out = self.cli(&["queues"]);
        assert!(
            out.status.success(),
            "khata queues: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the queue's plugin is loaded.
    pub async fn wait_plugin(&self, queue: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.queue(queue).await["version"].is_null() {
            assert!(
                Instant::now() < deadline,
                "plugin of {queue} not loaded; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The bytes of a guest built by `scripts/build-plugins`.
pub fn guest_bytes(name: &str) -> Vec<u8> {
    std::fs::read(guest(name)).expect("read guest")
}

/// A plugin version as the daemon names it: the first 12 hex digits of the
/// file's SHA-256.
pub fn short_hash(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))[..12].to_owned()
}

pub fn payload(v: Value) -> Value {
    json!({ "payload": v })
}

impl Daemon {
    /// Whether the daemon process is still running (not exited).
    /// Waits up to `limit` for the daemon to exit by itself; its status.
    pub async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            let c = self.child.as_mut().expect("running");
            if let Some(status) = c.try_wait().expect("try_wait") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "khata did not exit within {limit:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

/// A PostgreSQL server of one test's own, made by `scripts/pg-test-server`
/// (a fresh cluster on a free port), so that the test may stop and restart
/// it without disturbing other tests. Removed on drop, also on panic.
pub struct PgServer {
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub url: String,
    /// The cluster's directory.
    pub dir: PathBuf,
}

impl PgServer {
    fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("workspace root")
            .join("scripts/pg-test-server")
    }

    fn run(args: &[&str]) -> String {
        let out = Command::new(Self::script())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run scripts/pg-test-server");
        assert!(
            out.status.success(),
            "scripts/pg-test-server {}: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("UTF-8 output")
    }

    /// Starts a fresh cluster.
    pub fn start() -> PgServer {
        let out = Self::run(&["start"]);
        let var = |name: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("export {name}=")))
                .unwrap_or_else(|| panic!("scripts/pg-test-server start printed no {name}: {out}"))
                .to_owned()
        };
        PgServer {
            url: var("KHATA_TEST_PG_URL"),
            dir: PathBuf::from(var("KHATA_TEST_PG_DIR")),
        }
    }

    fn dir(&self) -> &str {
        self.dir.to_str().expect("UTF-8 cluster path")
    }

    /// `pg_ctl stop -m fast`: the server closes every connection and stops;
    /// the cluster stays.
    pub fn stop_server(&self) {
        Self::run(&["stop-server", self.dir()]);
    }

    /// Starts the stopped server again, on the same port.
    pub fn start_server(&self) {
        Self::run(&["start-server", self.dir()]);
    }

    /// `pg_ctl restart -m fast`.
    pub fn restart(&self) {
        Self::run(&["restart", self.dir()]);
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = Command::new(Self::script())
            .args(["stop", self.dir()])
            .stdin(Stdio::null())
            .output();
    }
}
