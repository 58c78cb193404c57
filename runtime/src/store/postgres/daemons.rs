//! Several daemons on one ledger: registration, the heartbeat that renews
//! this daemon's leases, and the listener of wake-ups (`LISTEN khata_wake`).

use super::*;

impl PostgresStore {
    /// Records this daemon in `daemons`. Durable when it returns.
    pub(super) async fn register(&self) -> Result<(), StoreError> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        let pid = i32::try_from(std::process::id()).unwrap_or(0);
        step!(self, Mode::Write, |tx| {
            exec(
                &tx,
                "INSERT INTO daemons (id, host, pid) VALUES ($1, $2, $3)",
                &[&self.daemon_id, &host, &pid],
            )
            .await?;
            Ok(())
        })
    }

    /// Renews this daemon's unexpired leases and its `daemons` row; returns
    /// the leases it held that are lost. Durable when it returns.
    pub(super) async fn heartbeat_step(&self) -> Result<Vec<LeaseRef>, StoreError> {
        // Leases entered before the renewal began were committed before it,
        // so the renewal sees every one of them.
        let before: Vec<LeaseRef> = self
            .held
            .lock()
            .map(|h| h.keys().cloned().collect())
            .unwrap_or_default();
        let lease_ms = self.lease_ms();
        let ids: Vec<&str> = before.iter().map(|l| l.job_id.as_str()).collect();
        let tokens: Vec<i64> = before.iter().map(|l| i64_of(l.token)).collect();
        // Only the leases of attempts still running here: a lease whose
        // attempt ended without its finish committing is left to expire.
        let renewed: Vec<(String, i64)> = step!(self, Mode::Write, |tx| {
            exec(
                &tx,
                "UPDATE daemons SET heartbeat_at = clock_timestamp() WHERE id = $1",
                &[&self.daemon_id],
            )
            .await?;
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            let r = rows(
                &tx,
                "UPDATE jobs j SET lease_expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond' \
                 FROM unnest($2::text[], $3::bigint[]) AS v(id, token) \
                 WHERE j.id = v.id AND j.lease_token = v.token AND j.lease_owner = $1 \
                   AND j.state = 'active' AND j.lease_expires_at > clock_timestamp() \
                 RETURNING j.id, j.lease_token",
                &[&self.daemon_id, &ids, &tokens, &lease_ms],
            )
            .await?;
            r.iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get::<_, Option<i64>>(1)?.unwrap_or(0))))
                .collect::<Result<Vec<_>, Fail>>()
        })?;
        let renewed: std::collections::HashSet<(String, u64)> =
            renewed.into_iter().map(|(id, t)| (id, u64_of(t))).collect();
        let expired_by = std::time::Instant::now() + self.lease_duration();
        let mut lost = Vec::new();
        if let Ok(mut held) = self.held.lock() {
            for l in before {
                if renewed.contains(&(l.job_id.clone(), l.token)) {
                    // Still held in memory (its attempt has not ended): its
                    // new expiry was set before this answer.
                    if let Some(by) = held.get_mut(&l) {
                        *by = expired_by;
                    }
                } else if held.remove(&l).is_some() {
                    // Still held in memory and not renewed: lost.
                    lost.push(l);
                }
            }
        }
        Ok(lost)
    }

    /// Starts the wake-up listener (once) and returns its stream.
    pub(super) fn start_listener(&self) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let task = AbortOnDrop(tokio::spawn(listen(self.cfg.clone(), tx)));
        if let Ok(mut l) = self.listener.lock() {
            *l = Some(task);
        }
        rx
    }
}

/// LISTENs on `khata_wake` on a connection of its own and forwards each
/// notification's queue name; after every (re)connection it sends `*`
/// (every queue), since notifications sent while it was not listening are
/// lost. Ends when the receiver is gone.
pub(super) async fn listen(
    cfg: tokio_postgres::Config,
    tx: tokio::sync::mpsc::UnboundedSender<String>,
) {
    let target = target_of(&cfg);
    let mut connected_once = false;
    loop {
        match cfg.connect(NoTls).await {
            Ok((client, mut connection)) => {
                let (msg_tx, mut msg_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
                let driver = AbortOnDrop(tokio::spawn(async move {
                    loop {
                        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                            Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                                if msg_tx.send(n.payload().to_owned()).is_err() {
                                    return;
                                }
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => {
                                tracing::warn!(error = %describe(&e), "the wake-up connection to PostgreSQL failed");
                                return;
                            }
                            None => return,
                        }
                    }
                }));
                match client
                    .batch_execute(&format!("LISTEN {WAKE_CHANNEL}"))
                    .await
                {
                    Ok(()) => {
                        if connected_once {
                            tracing::info!(database = %target, "listening for wake-ups again");
                        }
                        connected_once = true;
                        if tx.send("*".to_owned()).is_err() {
                            return;
                        }
                        while let Some(queue) = msg_rx.recv().await {
                            if tx.send(queue).is_err() {
                                return;
                            }
                        }
                        tracing::warn!(database = %target, "the wake-up connection closed; connecting again (queues poll meanwhile)");
                    }
                    Err(e) => {
                        tracing::warn!(database = %target, error = %describe(&e), "cannot LISTEN for wake-ups");
                    }
                }
                drop(client);
                drop(driver);
            }
            Err(e) => {
                tracing::warn!(database = %target, error = %describe(&e), "cannot connect for wake-ups; queues poll meanwhile");
            }
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(LISTEN_RETRY).await;
    }
}
