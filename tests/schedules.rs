//! Schedules through the real daemon (docs/jobs-toml.md#schedulesname): one job per fire time
//! under `schedule:<name>:<time>`, the catch-up policies, and no fire time
//! enqueued twice across a kill -9 or a lost marks file.

use crate::support;

use std::time::{Duration, SystemTime};

use chrono::{DateTime, Datelike, TimeZone, Utc};
use serde_json::Value;
use support::Daemon;

const QUEUE: &str = r#"
[queues.tick]
plugin = "echo"
"#;

/// Three schedules of one cron line, one per catch-up policy.
fn config(cron: &str) -> String {
    let mut out = QUEUE.to_owned();
    for policy in ["latest", "all", "none"] {
        out.push_str(&format!(
            "\n[schedules.{policy}]\nqueue = \"tick\"\ncron = \"{cron}\"\npayload = {{ policy = \"{policy}\" }}\ncatch_up = \"{policy}\"\n"
        ));
    }
    out
}

/// Ids of the jobs a schedule enqueued, oldest fire time first.
async fn fired(d: &Daemon, schedule: &str) -> Vec<String> {
    let (status, v) = d.call("GET", "/v1/jobs?queue=tick&limit=1000", None).await;
    assert_eq!(status, 200, "{v}");
    let prefix = format!("schedule:{schedule}:");
    let mut ids: Vec<String> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|j| j["id"].as_str())
        .filter(|id| id.starts_with(&prefix))
        .map(str::to_owned)
        .collect();
    ids.sort();
    ids
}

fn write_marks(d: &Daemon, at: SystemTime) {
    let data = d.dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let at = humantime::format_rfc3339_millis(at).to_string();
    let marks = serde_json::json!({"latest": at, "all": at, "none": at});
    std::fs::write(data.join("schedules.json"), marks.to_string()).unwrap();
}

async fn wait_count(d: &Daemon, schedule: &str, n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ids = fired(d, schedule).await;
        if ids.len() >= n {
            return ids;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{schedule}: {} of {n} jobs: {ids:?}",
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn missed_fire_times_follow_catch_up_and_never_fire_twice() {
    // Every 1 January, 00:00 UTC; the daemon was last here ten years ago.
    let mut d = Daemon::prepare(&config("0 0 1 1 *"), &[("echo", "echo")]);
    let mark = SystemTime::now() - Duration::from_secs(3660 * 86_400);
    write_marks(&d, mark);
    let (from, to): (DateTime<Utc>, DateTime<Utc>) = (mark.into(), SystemTime::now().into());
    let expected: Vec<String> = (from.year()..=to.year())
        .map(|y| Utc.with_ymd_and_hms(y, 1, 1, 0, 0, 0).unwrap())
        .filter(|t| *t > from && *t <= to)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .collect();
    assert!(expected.len() >= 10);

    d.start().await;
    d.wait_plugin("tick").await;
    let all = wait_count(&d, "all", expected.len()).await;
    let want: Vec<String> = expected
        .iter()
        .map(|t| format!("schedule:all:{t}"))
        .collect();
    assert_eq!(all, want, "catch_up = all: every missed fire time, once");
    let latest = wait_count(&d, "latest", 1).await;
    assert_eq!(
        latest,
        [format!("schedule:latest:{}", expected.last().unwrap())],
        "catch_up = latest: only the newest"
    );
    for id in all.iter().chain(&latest) {
        let j = d.wait_state(id, "completed", 30).await;
        assert!(
            j["result"]["policy"].is_string(),
            "the schedule's payload: {j}"
        );
    }
    let none_fired = fired(&d, "none").await;
    assert!(none_fired.is_empty(), "catch_up = none: {none_fired:?}");

    // The next fire time is shown, in the schedule's zone (UTC).
    let out = d.cli(&["schedules"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let next_year = format!("{}-01-01T00:00:00", to.year() + 1);
    assert!(text.contains("all") && text.contains(&next_year), "{text}");

    // A crash and a restart fire nothing again.
    d.kill9();
    d.start().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(fired(&d, "all").await, want);
    assert_eq!(fired(&d, "latest").await, latest);

    // Even with the marks lost and set back ten years, each fire time is
    // one job: its id is taken.
    d.kill9();
    write_marks(&d, mark);
    d.start().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(fired(&d, "all").await, want);
    assert_eq!(fired(&d, "latest").await, latest);
    assert!(fired(&d, "none").await.is_empty());
}

/// Firing as time passes, on the daemon's movable clock (`failpoints` build).
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_schedule_fires_once_per_fire_time_as_the_clock_moves() {
    // Daily, so that the seconds this test takes cannot span a fire time.
    let d = Daemon::start_new(&config("0 0 * * *"), &[("echo", "echo")]).await;
    d.wait_plugin("tick").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        fired(&d, "all").await.is_empty(),
        "a new schedule fires from now on"
    );

    let advance = async |by: &str| {
        let (status, v): (u16, Value) = d
            .call(
                "POST",
                "/v1/test/clock",
                Some(serde_json::json!({"advance": by})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    };
    advance("1d").await;
    for policy in ["latest", "all", "none"] {
        assert_eq!(wait_count(&d, policy, 1).await.len(), 1, "{policy}");
    }
    advance("1d").await;
    for policy in ["latest", "all", "none"] {
        let ids = wait_count(&d, policy, 2).await;
        assert_eq!(ids.len(), 2, "{policy}: {ids:?}");
        assert_ne!(ids[0], ids[1]);
    }
    // Five days at once: missed times follow the policy.
    advance("5d").await;
    assert_eq!(wait_count(&d, "all", 7).await.len(), 7);
    assert_eq!(wait_count(&d, "latest", 3).await.len(), 3);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        fired(&d, "none").await.len(),
        2,
        "none skips what was missed"
    );
    assert_eq!(fired(&d, "latest").await.len(), 3);
    assert_eq!(fired(&d, "all").await.len(), 7);
    // A scheduled job is counted as every enqueue is: 7 + 3 + 2.
    let text = d.metrics().await;
    let line = "khata_jobs_enqueued_total{queue=\"tick\"} 12";
    assert!(text.contains(line), "metrics lack {line:?}:\n{text}");
}

#[tokio::test]
async fn sighup_adds_changes_and_removes_schedules_without_refiring() {
    let daily = "\n[schedules.daily]\nqueue = \"tick\"\ncron = \"0 0 * * *\"\n";
    let d = Daemon::start_new(&format!("{QUEUE}{daily}"), &[("echo", "echo")]).await;
    d.wait_plugin("tick").await;
    let advance = async |by: &str| {
        let (status, v): (u16, Value) = d
            .call(
                "POST",
                "/v1/test/clock",
                Some(serde_json::json!({"advance": by})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    };
    let names = async || -> Vec<String> {
        let (status, v): (u16, Value) = d.call("GET", "/v1/schedules", None).await;
        assert_eq!(status, 200, "{v}");
        let mut names: Vec<String> = v["schedules"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                format!(
                    "{} {}",
                    s["name"].as_str().unwrap(),
                    s["cron"].as_str().unwrap()
                )
            })
            .collect();
        names.sort();
        names
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    advance("1d").await;
    assert_eq!(wait_count(&d, "daily", 1).await.len(), 1);

    // daily now fires at noon too; hourly is new.
    d.rewrite_config(&format!(
        "{QUEUE}\n[schedules.daily]\nqueue = \"tick\"\ncron = \"0 0,12 * * *\"\n\
         [schedules.hourly]\nqueue = \"tick\"\ncron = \"0 * * * *\"\n"
    ));
    d.hup();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while names().await != ["daily 0 0,12 * * *", "hourly 0 * * * *"] {
        assert!(
            std::time::Instant::now() < deadline,
            "reloaded schedules: {:?}",
            names().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        fired(&d, "daily").await.len(),
        1,
        "a changed schedule fires from now on: nothing fires again, nothing is caught up"
    );
    assert!(
        fired(&d, "hourly").await.is_empty(),
        "a new one fires from now on"
    );
    // Half a day: twelve hourly fire times (catch_up = latest: one job), and
    // daily's next fire time, by its new line.
    advance("12h").await;
    assert_eq!(wait_count(&d, "daily", 2).await.len(), 2);
    assert_eq!(wait_count(&d, "hourly", 1).await.len(), 1);

    // Removed: it fires no more.
    d.rewrite_config(&format!("{QUEUE}{daily}"));
    d.hup();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while names().await != ["daily 0 0 * * *"] {
        assert!(std::time::Instant::now() < deadline, "{:?}", names().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    advance("2h").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(fired(&d, "hourly").await.len(), 1);

    // A bad schedule refuses the whole file: the running ones stay.
    d.rewrite_config(&format!(
        "{QUEUE}{daily}\n[schedules.bad]\nqueue = \"tick\"\ncron = \"not a cron\"\n"
    ));
    d.hup();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(names().await, ["daily 0 0 * * *"]);
}

/// A fire time whose id another job holds (here: the same schedule's job
/// from before its payload changed) is skipped with one error line, and the
/// schedule goes on with its next fire time; it does not spin.
#[tokio::test]
async fn a_fire_time_whose_id_is_taken_is_skipped_once() {
    let schedule = |v: u32| {
        format!(
            "{QUEUE}\n[schedules.all]\nqueue = \"tick\"\ncron = \"0 0 * * *\"\npayload = {{ v = {v} }}\ncatch_up = \"all\"\n"
        )
    };
    let mut d = Daemon::start_new(&schedule(1), &[("echo", "echo")]).await;
    d.wait_plugin("tick").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let advance = async |d: &Daemon, by: &str| {
        let (status, v): (u16, Value) = d
            .call(
                "POST",
                "/v1/test/clock",
                Some(serde_json::json!({"advance": by})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    };
    advance(&d, "1d").await;
    let first = wait_count(&d, "all", 1).await.remove(0);
    assert!(d.terminate().success());

    // The payload changes and the marks go back before that fire time: the
    // daemon tries the same fire time, whose id is taken by payload 1.
    d.rewrite_config(&schedule(2));
    let fire: DateTime<Utc> = first
        .strip_prefix("schedule:all:")
        .unwrap()
        .parse()
        .unwrap();
    write_marks(&d, SystemTime::from(fire - chrono::Duration::seconds(1)));
    d.start().await;
    d.wait_plugin("tick").await;
    advance(&d, "1d").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    advance(&d, "1d").await;
    let ids = wait_count(&d, "all", 2).await;
    assert_eq!(ids.len(), 2, "{ids:?}");
    let log = d.log();
    assert_eq!(
        log.matches("fire time skipped").count(),
        1,
        "one line for the taken fire time:\n{log}"
    );
    assert!(!log.contains("could not enqueue"), "{log}");
    let old = d.job(&first).await;
    assert_eq!(old["payload"]["v"], 1, "{old}");
    let new = d.job(&ids[1]).await;
    assert_eq!(new["payload"]["v"], 2, "{new}");
}

/// A store that keeps refusing a schedule's enqueue: the schedule backs
/// off and logs the cause once, then fires once the store takes it again.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_failing_enqueue_backs_off_and_is_logged_once() {
    let mut d = Daemon::prepare(
        &format!("{QUEUE}\n[schedules.all]\nqueue = \"tick\"\ncron = \"0 0 * * *\"\n"),
        &[("echo", "echo")],
    );
    // Four refusals: tried at 0, 1, 3 and 7 s, taken at 15 s.
    d.env(
        "FAILPOINTS",
        "schedule::enqueue=4*return(the disk is on fire)",
    );
    d.start().await;
    d.wait_plugin("tick").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, v) = d
        .call(
            "POST",
            "/v1/test/clock",
            Some(serde_json::json!({"advance": "1d"})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let started = std::time::Instant::now();
    let deadline = started + Duration::from_secs(40);
    while fired(&d, "all").await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "{}", d.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        started.elapsed() >= Duration::from_secs(7),
        "four refusals back off 1 + 2 + 4 + 8 s, fired after {:?}",
        started.elapsed()
    );
    let log = d.log();
    assert_eq!(
        log.matches("schedule could not enqueue").count(),
        1,
        "the cause is logged once:\n{log}"
    );
    assert!(log.contains("the disk is on fire"), "{log}");
    assert!(log.contains("schedule enqueues again"), "{log}");
    let (_, view) = d.call("GET", "/v1/schedules", None).await;
    assert!(view["schedules"][0]["last_error"].is_null(), "{view}");
}
