//! A server's checkpoints: its shard file at each checkpoint step, and on server 0 the manifest
//! once every server's entry is in. Sans-I/O for the network (the entry for server 0 and the
//! run's step count go out as [`Output`]s); the files are written here.

use std::collections::BTreeMap;
use std::ops::Range;

use ringtmp_contract::error::{Error, Result};
use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_wire::{Control, Message};

use super::events::Output;
use crate::driver::{PsJob, shard_range};

/// A server's checkpointing: it counts iterations applied to its shard (under BSP one per
/// applied mean; otherwise one per `W` pushes) and, at each checkpoint step, writes its shard
/// file and tells server 0, which writes the manifest once every server's entry is in.
///
/// Under BSP every server's file holds exactly iteration `step`'s parameters. Under the other
/// models servers apply pushes as they come, so each file holds `step · W` pushes but not
/// necessarily the same ones: the checkpoint is what a worker could have pulled, not one global
/// instant, and a resumed run restarts the data at unit `step · W`.
pub(super) struct Checkpoints {
    pub(super) range: Range<usize>,
    pub(super) iterations: u64,
    pub(super) pushes: u64,
    /// Server 0: checkpoint step → each server's file entry (JSON) that has arrived.
    pub(super) entries: BTreeMap<u64, Vec<Option<String>>>,
}

impl Checkpoints {
    /// One push applied (not under BSP); whether it completes an iteration (`workers` pushes).
    pub(super) fn push_applied(&mut self, workers: usize) -> bool {
        self.pushes += 1;
        self.pushes.is_multiple_of(workers as u64)
    }

    /// An iteration applied: counted, and at a checkpoint step the shard's file written and
    /// its entry sent to server 0 (or recorded, on server 0).
    pub(super) fn iteration_done(
        &mut self,
        job: &PsJob,
        s: usize,
        model: &Stage,
        params: &[f32],
        optimizer: &Optimizer,
        out: &mut Vec<Output>,
    ) -> Result<()> {
        self.iterations += 1;
        if s == 0 {
            out.push(Output::StepDone);
        }
        let step = job.first_step() + self.iterations;
        if !job.checkpoint_due(step) {
            return Ok(());
        }
        let entry = checkpoint::write_range(
            &job.checkpoint_dir(step),
            &format!("server-{s}.safetensors"),
            model,
            self.range.clone(),
            params,
            optimizer,
        )?;
        let entry = serde_json::to_string(&entry).map_err(|e| Error::Config(e.to_string()))?;
        if s == 0 {
            self.record(job, step, 0, vec![entry], model)
        } else {
            out.push(Output::Send {
                to: 0,
                message: Message::Control(Control::Checkpoint {
                    step,
                    files: vec![entry],
                }),
            });
            Ok(())
        }
    }

    /// Server 0: server `from`'s file for `step`; the manifest once all are in.
    pub(super) fn record(
        &mut self,
        job: &PsJob,
        step: u64,
        from: usize,
        files: Vec<String>,
        model: &Stage,
    ) -> Result<()> {
        let slots = self
            .entries
            .entry(step)
            .or_insert_with(|| vec![None; job.servers]);
        let [entry] = <[String; 1]>::try_from(files).map_err(|_| {
            Error::Config(format!(
                "server rank {from}: a checkpoint entry must name one file"
            ))
        })?;
        slots[from] = Some(entry);
        if slots.iter().any(Option::is_none) {
            return Ok(());
        }
        let files = self
            .entries
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .map(|f| {
                serde_json::from_str(&f).map_err(|e| {
                    Error::Config(format!("a server's checkpoint entry is invalid: {e}"))
                })
            })
            .collect::<Result<Vec<checkpoint::FileEntry>>>()?;
        let total = model.params().len();
        let manifest = job.spec.manifest(
            "ps",
            step,
            job.spec.batch_size * job.workers,
            (0..job.servers)
                .map(|s| checkpoint::range_layers(model, &shard_range(total, job.servers, s)))
                .collect(),
            files,
            Vec::new(),
        );
        checkpoint::write_manifest(&job.checkpoint_dir(step), &manifest)?;
        if let Some(keep) = job.spec.keep_checkpoints {
            checkpoint::retain_newest(&job.spec.out.join("checkpoints"), keep)?;
        }
        Ok(())
    }
}
