//! The operator dashboard (docs/api.md#the-dashboard) in a real headless browser: Debian's
//! `chromium`, driven over WebDriver by `chromedriver` (package
//! `chromium-driver`), against the real daemon. The page is read and clicked
//! as an operator would; what it claims is checked against the API.
//!
//! Screenshots of the pages land in `target/tmp/dashboard-screenshots/`.

use crate::servers;
use crate::support;

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use support::{Daemon, payload};

/// How long the page may take to show something before a wait fails.
const WAIT: Duration = Duration::from_secs(30);

/// A chromedriver with one headless chromium session on a page.
struct Browser {
    client: Option<Client>,
    driver: Child,
    dir: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a free port and a session in it.
    async fn start() -> Browser {
        let chromedriver =
            std::env::var("KHATA_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_owned());
        let chromium =
            std::env::var("KHATA_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".to_owned());
        let dir = tempfile::tempdir().expect("tempdir");
        let port = support::free_port();
        let log = std::fs::File::create(dir.path().join("chromedriver.log")).expect("log");
        // Its own process group, so that the browser it starts is ended with
        // it even when a test fails half-way.
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {chromedriver}: {e}; install Debian's chromium and \
                     chromium-driver (apt-get install chromium chromium-driver) or set \
                     KHATA_CHROMEDRIVER"
                )
            });
        let mut browser = Browser {
            client: None,
            driver,
            dir,
        };
        let url = format!("http://127.0.0.1:{port}");
        let http = support::client();
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(r) = http.get(format!("{url}/status")).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == true
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver not ready; log:\n{}",
                browser.driver_log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile = browser.dir.path().join("profile");
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".to_owned(),
            json!({
                "binary": chromium,
                "args": [
                    "--headless",
                    "--no-sandbox",
                    "--disable-background-networking",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                    "--window-size=1280,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(&url)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "no WebDriver session: {e}; chromedriver log:\n{}",
                    browser.driver_log()
                )
            });
        browser.client = Some(client);
        browser
    }

    fn c(&self) -> &Client {
        self.client.as_ref().expect("session")
    }

    fn driver_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("chromedriver.log")).unwrap_or_default()
    }

    async fn goto(&self, url: &str) {
        self.c().goto(url).await.expect("goto");
    }

    /// The page's visible text, for failure messages.
    async fn page_text(&self) -> String {
        match self.c().find(Locator::Css("body")).await {
            Ok(body) => body.text().await.unwrap_or_default(),
            Err(e) => format!("(no body: {e})"),
        }
    }

    /// The text of the first element matching `css`, if there is one now.
    async fn text(&self, css: &str) -> Option<String> {
        let e = self.c().find(Locator::Css(css)).await.ok()?;
        e.text().await.ok()
    }

    /// Waits until the element `css` exists and its text satisfies `ok`.
    async fn wait_text(&self, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let text = self.text(css).await;
            if let Some(t) = &text
                && ok(t)
            {
                return t.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{css}: not {what} (text: {text:?}); page:\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_text_is(&self, css: &str, want: &str) {
        self.wait_text(css, &format!("{want:?}"), |t| t.trim() == want)
            .await;
    }

    async fn count(&self, css: &str) -> usize {
        self.c()
            .find_all(Locator::Css(css))
            .await
            .map_or(0, |v| v.len())
    }

    async fn wait_count(&self, css: &str, n: usize) {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.count(css).await;
            if got == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{css}: {got} elements, not {n}; page:\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the element `css` exists and is shown.
    async fn shown(&self, css: &str) -> bool {
        match self.c().find(Locator::Css(css)).await {
            Ok(e) => e.is_displayed().await.unwrap_or(false),
            Err(_) => false,
        }
    }

    async fn wait_shown(&self, css: &str) {
        let deadline = Instant::now() + WAIT;
        while !self.shown(css).await {
            assert!(
                Instant::now() < deadline,
                "{css} is not shown; page:\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clicks the element `css` once it is there (the page redraws what
    /// changed every two seconds, so a found element may be replaced before
    /// the click: then it is found again).
    async fn click(&self, css: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let err = match self.c().find(Locator::Css(css)).await {
                Ok(e) => match e.click().await {
                    Ok(()) => return,
                    Err(err) => err.to_string(),
                },
                Err(err) => err.to_string(),
            };
            assert!(
                Instant::now() < deadline,
                "cannot click {css}: {err}; page:\n{}",
                self.page_text().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for the confirm dialog and returns its text (leaving it open).
    async fn confirm_text(&self) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            match self.c().get_alert_text().await {
                Ok(t) => return t,
                Err(e) => assert!(Instant::now() < deadline, "no confirm dialog: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn type_into(&self, css: &str, text: &str) {
        let e = self
            .c()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"));
        e.clear().await.expect("clear");
        e.send_keys(text).await.expect("type");
    }

    /// Picks the option with `value` in the select `css`.
    async fn select(&self, css: &str, value: &str) {
        self.click(&format!("{css} option[value=\"{value}\"]"))
            .await;
        let deadline = Instant::now() + WAIT;
        loop {
            let e = self.c().find(Locator::Css(css)).await.expect("select");
            if e.prop("value").await.ok().flatten().as_deref() == Some(value) {
                return;
            }
            assert!(Instant::now() < deadline, "{css}: {value} not selected");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn js(&self, script: &str) -> Value {
        self.c().execute(script, vec![]).await.expect("execute")
    }

    /// Saves a screenshot of the window for the docs.
    async fn screenshot(&self, name: &str) {
        let png = self.c().screenshot().await.expect("screenshot");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-screenshots");
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        std::fs::write(dir.join(format!("{name}.png")), png).expect("write screenshot");
    }

    /// Ends the session (the browser quits) and chromedriver.
    async fn close(mut self) {
        if let Some(c) = self.client.take() {
            let _ = c.close().await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and the browser it started.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.driver.id())])
            .status();
        let _ = self.driver.wait();
    }
}

/// GET `path` on the daemon with its token; the JSON body.
async fn get(d: &Daemon, path: &str) -> Value {
    let (status, v) = d.call("GET", path, None).await;
    assert_eq!(status, 200, "GET {path}: {v}");
    v
}

/// Polls GET `path` until `ok`, and returns that answer.
async fn wait_api(d: &Daemon, path: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let v = get(d, path).await;
        if ok(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path}: not {what}: {v}\nlog:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Markup in a payload: the page must show it as text.
const XSS: &str = "<img src=x onerror=window.__xss=1>";
const XSS_SCRIPT: &str = "<script>window.__xss=2</script>";

#[tokio::test]
async fn the_page_shows_queues_and_jobs_retries_dead_jobs_and_resolves_fences() {
    // A provider that takes the request and hangs up: the charge's outcome
    // is unknown, and under `on_uncertain = "skip"` its fence is uncertain.
    let (addr, hits) = servers::black_hole().await;
    let config = format!(
        r#"
[queues.echo]
plugin = "echo"

[queues.chaos]
plugin = "chaos"
max_attempts = 1
grants = {{ kv = true }}

[queues.charge]
plugin = "charge_customer"
grants = {{ http = ["payments"] }}
max_attempts = 1
on_uncertain = "skip"

[http.payments]
base_url = "http://{addr}"
timeout = "2s"

[schedules.new-year]
queue = "echo"
cron = "0 3 1 1 *"
payload = {{ from = "schedule" }}
"#
    );
    let d = Daemon::start_new(
        &config,
        &[
            ("echo", "echo"),
            ("chaos", "chaos"),
            ("charge_customer", "charge_customer"),
        ],
    )
    .await;
    for q in ["echo", "chaos", "charge"] {
        d.wait_plugin(q).await;
    }

    let batch: Vec<Value> = (1..=12)
        .map(|i| json!({"id": format!("echo-{i:02}"), "payload": {"n": i}}))
        .collect();
    let (status, v) = d
        .call(
            "POST",
            "/v1/queues/echo/jobs/batch",
            Some(json!({"jobs": batch})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    d.enqueue(
        "echo",
        json!({"id": "xss", "payload": {"note": XSS, "also": XSS_SCRIPT}}),
    )
    .await;
    d.enqueue("chaos", json!({"id": "doomed", "payload": {"do": "fail"}}))
        .await;
    d.enqueue(
        "charge",
        json!({"id": "charge-7", "payload": {"order_id": 7, "amount": 1250, "currency": "EUR", "customer": "cus_7"}}),
    )
    .await;
    d.wait_queue("echo", "13 completed", 60, |q| {
        q["counts"]["completed"] == 13
    })
    .await;
    d.wait_state("doomed", "dead", 30).await;
    d.wait_state("charge-7", "dead", 30).await;
    assert_eq!(*hits.lock().unwrap(), 1, "the charge left once");

    let b = Browser::start().await;
    b.goto(&format!("{}/", d.url)).await;

    // Queues with their counts, plugin versions and schedules.
    let cell = |q: &str, s: &str| format!("#queues tr[data-queue=\"{q}\"] td[data-state=\"{s}\"]");
    b.wait_text_is(&cell("echo", "completed"), "13").await;
    b.wait_text_is(&cell("chaos", "dead"), "1").await;
    b.wait_text_is(&cell("charge", "dead"), "1").await;
    for (q, counts) in [("echo", "0 0 0 13 0 0"), ("chaos", "0 0 0 0 1 0")] {
        let mut shown = Vec::new();
        for s in [
            "waiting",
            "delayed",
            "active",
            "completed",
            "dead",
            "cancelled",
        ] {
            shown.push(b.text(&cell(q, s)).await.expect("count cell"));
        }
        assert_eq!(shown.join(" "), counts, "queue {q}");
    }
    for q in ["echo", "chaos", "charge"] {
        let version = d.queue(q).await["version"].as_str().unwrap().to_owned();
        b.wait_text_is(
            &format!("#queues tr[data-queue=\"{q}\"] td.version"),
            &version,
        )
        .await;
    }
    assert_eq!(b.count("#queues tr.load-error").await, 0);
    let schedules = get(&d, "/v1/schedules").await;
    let next_fire = schedules["schedules"][0]["next_fire"].as_str().unwrap();
    let shown = b
        .c()
        .find(Locator::Css(
            "#schedules tr[data-schedule=\"new-year\"] td.next-fire time",
        ))
        .await
        .expect("next fire")
        .attr("datetime")
        .await
        .expect("datetime");
    assert_eq!(shown.as_deref(), Some(next_fire));

    // Live counts: a job enqueued now shows up without a reload.
    b.js("window.__probe = 'same page'; return null").await;
    d.enqueue("echo", json!({"id": "live", "payload": {"live": true}}))
        .await;
    b.wait_text_is(&cell("echo", "completed"), "14").await;
    assert_eq!(b.js("return window.__probe").await, "same page");

    // Dead jobs, with their errors; uncertain fences.
    let dead = "#dead tr[data-job=\"doomed\"]";
    b.wait_text(
        &format!("{dead} td.error-text"),
        "the handler's error",
        |t| t.contains("asked to fail"),
    )
    .await;
    b.wait_shown("#dead tr[data-job=\"charge-7\"]").await;
    let fence =
        "#fences tr[data-namespace=\"charge\"][data-kind=\"http\"][data-key=\"order-charge-7\"]";
    b.wait_shown(fence).await;
    b.screenshot("overview").await;
    let text = b.page_text().await;
    assert!(
        !text
            .split(['\n', '\t'])
            .any(|l| ["null", "undefined", "NaN", "[object Object]"].contains(&l.trim())),
        "no raw JavaScript values on the page:\n{text}"
    );

    // Retry sends the dead job back: a second attempt runs (and fails again).
    b.click(&format!("{dead} button.retry")).await;
    b.wait_text("#flash", "the retry's confirmation", |t| {
        t.contains("doomed") && t.contains("waiting")
    })
    .await;
    let j = wait_api(&d, "/v1/jobs/doomed", "retried and dead again", |j| {
        j["attempts"].as_array().unwrap().len() == 2 && j["state"] == "dead"
    })
    .await;

    // The job's detail: attempts (number, outcome, error, times) as the API
    // has them.
    b.click(&format!("{dead} a.job-link")).await;
    b.wait_text_is("#job-title", "doomed").await;
    b.wait_count("#job-attempts tbody tr", 2).await;
    for a in j["attempts"].as_array().unwrap() {
        let row = format!("#job-attempts tr[data-attempt=\"{}\"]", a["number"]);
        b.wait_text_is(&format!("{row} td.outcome"), a["outcome"].as_str().unwrap())
            .await;
        let error = b.text(&format!("{row} td.error-text")).await.unwrap();
        assert!(error.contains("asked to fail"), "{error}");
        let started = b
            .c()
            .find(Locator::Css(&format!("{row} time")))
            .await
            .expect("start time")
            .attr("datetime")
            .await
            .expect("datetime");
        assert_eq!(started.as_deref(), a["started_at"].as_str());
    }
    b.screenshot("job").await;

    // The charge's effects, as the API has them.
    b.click("#dead tr[data-job=\"charge-7\"] a.job-link").await;
    b.wait_text_is("#job-title", "charge-7").await;
    let j = get(&d, "/v1/jobs/charge-7").await;
    let effects = j["effects"].as_array().unwrap();
    assert!(!effects.is_empty(), "{j}");
    b.wait_count("#job-effects tbody tr", effects.len()).await;
    for e in effects {
        let row = format!(
            "#job-effects tr[data-key=\"{}\"]",
            e["key"].as_str().unwrap()
        );
        b.wait_text_is(&format!("{row} td.outcome"), e["outcome"].as_str().unwrap())
            .await;
    }

    // Resolving asks first: dismissed, nothing happens (a "not-done" would
    // release the fence, and the "done" below would then be refused).
    b.click(&format!("{fence} button.resolve-not-done")).await;
    let question = b.confirm_text().await;
    assert!(
        question.contains("order-charge-7") && question.contains("NOT DONE"),
        "{question}"
    );
    b.c().dismiss_alert().await.expect("dismiss");
    b.click(&format!("{fence} button.resolve-done")).await;
    let question = b.confirm_text().await;
    assert!(
        question.contains("order-charge-7") && question.contains("DONE"),
        "{question}"
    );
    b.c().accept_alert().await.expect("accept");
    let fences = wait_api(&d, "/v1/fences?namespace=charge", "resolved done", |v| {
        v["fences"]
            .as_array()
            .is_some_and(|f| f.len() == 1 && f[0]["state"] == "done")
    })
    .await;
    assert_eq!(fences["fences"][0]["key"], "order-charge-7");
    b.wait_count(fence, 0).await;
    b.wait_text("#fences .body", "empty", |t| t.starts_with("None"))
        .await;
    assert_eq!(*hits.lock().unwrap(), 1, "resolving sends nothing");

    // Jobs by queue and state, a page at a time (newest first).
    b.click("#job-close").await;
    b.select("#filter-queue", "echo").await;
    b.select("#filter-state", "completed").await;
    b.select("#filter-limit", "10").await;
    b.wait_text_is("#page-number", "page 1").await;
    b.wait_count("#jobs tbody tr", 10).await;
    b.wait_shown("#jobs tr[data-job=\"live\"]").await;
    b.click("#next-page").await;
    b.wait_text_is("#page-number", "page 2").await;
    b.wait_count("#jobs tbody tr", 4).await;
    b.wait_shown("#jobs tr[data-job=\"echo-01\"]").await;
    assert!(
        !b.c()
            .find(Locator::Css("#next-page"))
            .await
            .unwrap()
            .is_enabled()
            .await
            .unwrap(),
        "the last page"
    );
    b.click("#prev-page").await;
    b.wait_text_is("#page-number", "page 1").await;
    b.wait_shown("#jobs tr[data-job=\"xss\"]").await;
    b.select("#filter-state", "dead").await;
    b.select("#filter-queue", "").await;
    b.wait_count("#jobs tbody tr", 2).await;

    // Markup in a payload is shown as text, in the list and in the detail.
    b.select("#filter-state", "").await;
    let payload_cell = b
        .wait_text(
            "#jobs tr[data-job=\"xss\"] code.payload",
            "the payload",
            |t| t.contains(XSS),
        )
        .await;
    assert!(payload_cell.contains(XSS_SCRIPT), "{payload_cell}");
    b.click("#jobs tr[data-job=\"xss\"] a.job-link").await;
    b.wait_text_is("#job-title", "xss").await;
    for part in ["#job-payload", "#job-result"] {
        let text = b
            .wait_text(part, "the payload as text", |t| t.contains(XSS))
            .await;
        assert!(text.contains(XSS_SCRIPT), "{part}: {text}");
    }
    assert_eq!(b.count("img").await, 0, "no element made from the payload");
    assert_eq!(b.count("body script").await, 0);
    assert_eq!(b.js("return window.__xss === undefined").await, true);

    b.close().await;
}

#[tokio::test]
async fn with_a_token_the_page_asks_for_it_and_then_works() {
    let token = "dash-s3cret-0123456789";
    let mut d = Daemon::prepare_with(
        "[queues.echo]\nplugin = \"echo\"\n",
        &[("echo", "echo")],
        &format!("token = \"{token}\""),
    );
    d.start().await;
    d.wait_plugin("echo").await;
    let id = d.enqueue("echo", payload(json!({"hello": "token"}))).await;
    d.wait_state(&id, "completed", 30).await;

    // The page and its files need no token and hold no data; the API does.
    let http = support::client();
    let page = http.get(format!("{}/", d.url)).send().await.unwrap();
    assert_eq!(page.status().as_u16(), 200);
    let header = |name: &str| {
        page.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    assert!(header("content-type").starts_with("text/html"));
    let csp = header("content-security-policy");
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    assert_eq!(header("x-content-type-options"), "nosniff");
    let html = page.text().await.unwrap();
    assert!(html.contains("<script src=\"dashboard.js\""), "{html}");
    assert!(
        !html.contains(&id) && !html.contains(token),
        "no data in the page"
    );
    for (path, kind) in [
        ("/dashboard.js", "text/javascript"),
        ("/dashboard.css", "text/css"),
    ] {
        let r = http.get(format!("{}{path}", d.url)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
        let h = r.headers();
        assert!(h["content-type"].to_str().unwrap().starts_with(kind));
        assert_eq!(h["x-content-type-options"], "nosniff");
    }
    let api = http
        .get(format!("{}/v1/queues", d.url))
        .send()
        .await
        .unwrap();
    assert_eq!(api.status().as_u16(), 401, "the API still needs the token");

    let b = Browser::start().await;
    b.goto(&format!("{}/", d.url)).await;
    b.wait_shown("#token-form").await;
    b.wait_text("#token-message", "asking for a token", |t| {
        t.contains("needs a token")
    })
    .await;
    assert!(!b.shown("#main").await, "no data without the token");
    b.screenshot("token").await;

    // A wrong token is refused, and asked for again.
    b.type_into("#token-input", "wrong").await;
    b.click("#token-submit").await;
    b.wait_text("#token-message", "refused", |t| t.contains("refused"))
        .await;
    b.wait_shown("#token-form").await;
    assert_eq!(
        b.js("return sessionStorage.getItem('khata.token')").await,
        Value::Null
    );

    b.type_into("#token-input", token).await;
    b.click("#token-submit").await;
    let cell = "#queues tr[data-queue=\"echo\"] td[data-state=\"completed\"]";
    b.wait_text_is(cell, "1").await;
    assert!(!b.shown("#token-form").await);
    b.wait_shown(&format!("#jobs tr[data-job=\"{id}\"]")).await;
    assert_eq!(
        b.js("return sessionStorage.getItem('khata.token')").await,
        token
    );

    // The tab keeps it: a reload does not ask again.
    b.c().refresh().await.expect("reload");
    b.wait_text_is(cell, "1").await;
    assert!(!b.shown("#token-form").await);

    b.close().await;
}
