//! Running a ring: the job every node runs and what master and stages share ([`driver`]), the
//! master's loop (rank 0: data, stage 0, loss, outputs; `master`) and every other stage's
//! (`worker`), and the per-stage decision rules they follow ([`schedule`]: `gpipe`, `1f1b`,
//! `async`, with their simulation).

pub mod driver;
pub(crate) mod master;
pub mod messages;
pub mod schedule;
mod worker;
