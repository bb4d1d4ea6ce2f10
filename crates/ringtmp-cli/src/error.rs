//! The CLI's errors and exit statuses: a user's mistake is one message and exit status 2, a
//! run-time failure exit status 1, a signal 128 + its number; the error chain is said once.

/// An error in what the user asked for (exit status 2).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The launcher was stopped by a signal (exit status 128 + the signal's number).
#[derive(Debug)]
pub struct Interrupted {
    /// The signal's number.
    pub signal: i32,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "interrupted by {}; the nodes were stopped",
            signal_name(self.signal)
        )
    }
}

impl std::error::Error for Interrupted {}

/// A node of a local launch failed at run time (not a usage error, not a signal): which one, so
/// the launcher can restart the run without it (`--max-restarts`).
#[derive(Debug)]
pub struct NodeFailed {
    /// The node that caused the failure.
    pub rank: u32,
    /// What went wrong, for the user.
    pub message: String,
}

impl std::fmt::Display for NodeFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for NodeFailed {}

/// The error chain on one line, outermost first. A cause whose text its wrapper already ends with
/// (an I/O error that a `"{path}: {source}"` message quotes) is said once, not twice.
pub fn describe(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.ends_with(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// 2 when any error in the chain is the user's input, 128 + N when signal N stopped the run, 1
/// otherwise.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if let Some(i) = cause.downcast_ref::<Interrupted>() {
            return u8::try_from(128 + i.signal).unwrap_or(1);
        }
        let usage = if cause.downcast_ref::<UsageError>().is_some() {
            Some(true)
        } else if let Some(e) = cause.downcast_ref::<ringtmp_strategy::Error>() {
            Some(e.is_usage())
        } else if cause
            .downcast_ref::<ringtmp_transport::TransportError>()
            .is_some()
        {
            Some(false)
        } else if let Some(e) = cause.downcast_ref::<ringtmp_model::Error>() {
            Some(e.is_usage())
        } else if cause.downcast_ref::<ringtmp_data::Error>().is_some() {
            Some(true)
        } else {
            // A file the user named that is missing, or a place they named that cannot be
            // written: their input.
            cause
                .downcast_ref::<std::io::Error>()
                .and_then(|e| ringtmp_model::is_the_users_path(e).then_some(true))
        };
        if let Some(usage) = usage {
            return if usage { 2 } else { 1 };
        }
    }
    1
}

/// `SIGTERM` and friends by name.
pub fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGKILL => "SIGKILL".into(),
        other => format!("signal {other}"),
    }
}
