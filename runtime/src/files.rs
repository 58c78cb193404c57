//! The daemon's files are its user's alone.
//!
//! The ledger holds every payload, result and effect record; the outbox
//! holds whole emails. [`private`] sets the process's umask to `077` before
//! anything is created, so that every directory the daemon makes is `0700`
//! and every file `0600` (SQLite's WAL and shared-memory files, sled's
//! files, the outbox, the code cache, `schedules.json`), whatever umask it
//! was started with. systemd's unit says the same (`UMask=0077`,
//! `StateDirectoryMode=0700`). A data directory that already exists with
//! wider permissions is left as it is, with a warning naming the command
//! that fixes it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use rustix::fs::Mode;

/// Makes everything this process creates from now on private to its user.
pub fn private() {
    rustix::process::umask(Mode::from_raw_mode(0o077));
}

/// Warns when `dir` exists and others may read or enter it.
pub fn warn_if_shared(dir: &Path) {
    if let Ok(meta) = std::fs::metadata(dir) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                dir = %dir.display(),
                mode = %format!("{mode:o}"),
                "the data directory can be read by other users; it holds every payload and result: chmod 700 {}",
                dir.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn what_the_process_creates_after_private_is_its_users_alone() {
        super::private();
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("data");
        std::fs::create_dir_all(sub.join("outbox")).unwrap();
        std::fs::write(sub.join("khata.db"), b"x").unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&sub), 0o700);
        assert_eq!(mode(&sub.join("outbox")), 0o700);
        assert_eq!(mode(&sub.join("khata.db")), 0o600);
    }
}
