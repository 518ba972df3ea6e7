//! Per-rank optimizer shards beside rank 0's checkpoint, so `--save` and
//! `--resume` work with ZeRO 1/2 and the optimizer on the host.
//!
//! Rank 0 writes the checkpoint as without sharding (`Trainer::save`: the
//! whole model, every rank holds it), then every rank writes its optimizer
//! shard (`FlatOptim::save_state`) into that directory as
//! `optimizer-shard-I-of-N.bin`, between two barriers: the first waits for
//! rank 0's directory to exist, the second keeps rank 0's next save (which
//! replaces the directory) from racing a slower rank's write. Every rank
//! must see the same directory: one process with `--devices`, or a
//! filesystem the processes share. On resume each rank reads the model and
//! its own shard; a checkpoint of another rank count is an error that says
//! how many shards it holds.
//!
//! ZeRO-3 and parameter offload (`shard::zero3`, the trainer's model a
//! skeleton): every rank takes part in gathering the whole model (`save`),
//! rank 0 writes the checkpoint from it as without sharding, and the
//! gathered copy is dropped at once. On resume every rank loads rank 0's
//! record whole and cuts its own weight shards from it (`Zero3::load_whole`,
//! the sharding `for_plan` does). The fp32 master shard is taken from the
//! weights again, except where it holds more than they give back (16-bit
//! weights): then it is written beside the optimizer shard as
//! `master-shard-I-of-N.bin` (little-endian f32). So it is with ZeRO 1/2
//! and 16-bit weights, whose master is a shard of the flat vector (no file
//! name tells the two layouts apart: the optimizer shard's does). ZeRO-3's optimizer shards
//! over several ranks are laid out per unit: `optimizer-shard-I-of-N-per-unit.bin`.

use crate::distributed::Collective;
use crate::ops::ExecAutodiff;
use crate::train::Trainer;
use crate::RunError;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use std::path::{Path, PathBuf};

/// Where shard `index` of `shards` lives in checkpoint `dir`. ZeRO-3's
/// shards over more than one rank (`per_unit`) hold each unit's piece, not a
/// piece of the whole flat vector as ZeRO 1/2's: their own name, so that
/// one is never resumed as the other (a checkpoint does not record the
/// stage, and the lengths may agree).
pub fn shard_file(dir: &Path, index: usize, shards: usize, per_unit: bool) -> PathBuf {
    let unit = if per_unit { "-per-unit" } else { "" };
    dir.join(format!("optimizer-shard-{index}-of-{shards}{unit}.bin"))
}

/// This rank's optimizer shard (index, count, per unit); `None` without a
/// sharded optimizer.
fn this_shard<B: ExecAutodiff>(trainer: &Trainer<B>) -> Option<(usize, usize, bool)> {
    match (trainer.zero3(), trainer.zero()) {
        (Some(z), _) => {
            let (index, shards) = z.optimizer_shard();
            Some((index, shards, shards > 1))
        }
        (None, Some(z)) => Some((z.index(), z.shards(), false)),
        (None, None) => None,
    }
}

/// Where the fp32 master shard `index` of `shards` lives in checkpoint `dir`.
pub fn master_file(dir: &Path, index: usize, shards: usize) -> PathBuf {
    dir.join(format!("master-shard-{index}-of-{shards}.bin"))
}

/// Write the checkpoint of this step: rank 0 (`writer`) the model, every
/// rank its optimizer shard. With ZeRO-3 every rank gathers the whole model
/// (a collective call every rank must make). Every rank calls it at the
/// same step.
pub fn save<B: ExecAutodiff>(
    trainer: &mut Trainer<B>,
    dir: &Path,
    writer: bool,
) -> Result<(), RunError> {
    if trainer.zero3().is_some() {
        let whole = trainer.whole_model()?;
        if writer {
            trainer.save_model(&whole, dir)?;
        }
    } else if writer {
        trainer.save(dir)?;
    }
    save_shard(trainer, dir, writer)
}

/// This rank's optimizer state and its fp32 master when that is not
/// derived from the weights.
fn shard_state<B: ExecAutodiff>(
    trainer: &Trainer<B>,
) -> Result<(Vec<u8>, Option<Vec<f32>>), RunError> {
    match (trainer.zero3(), trainer.zero()) {
        (Some(z), _) => Ok((z.optimizer().save_state()?, z.master_state()?)),
        (None, Some(z)) => Ok((z.optimizer().save_state()?, z.master_state()?)),
        (None, None) => Ok((Vec::new(), None)),
    }
}

/// Every rank waits here for every other.
fn barrier<I: Backend>(c: Option<&Collective<I>>, device: &I::Device) -> Result<(), RunError> {
    if let Some(c) = c {
        // `ranks` values: burn-collective's ring cuts the tensor per rank.
        c.mean(Tensor::<I, 1>::zeros([c.ranks() as usize], device))?;
    }
    Ok(())
}

/// After rank 0's `Trainer::save(dir)` (`writer`): this rank's optimizer
/// shard into `dir`. Every rank calls it at the same step.
pub fn save_shard<B: ExecAutodiff>(
    trainer: &Trainer<B>,
    dir: &Path,
    writer: bool,
) -> Result<(), RunError> {
    let Some((index, shards, per_unit)) = this_shard(trainer) else {
        return Ok(());
    };
    let device = trainer.device.clone();
    barrier(trainer.collective(), &device)?;
    // One shard: every rank holds the same state, rank 0 writes it.
    if shards == 1 && !writer {
        return barrier(trainer.collective(), &device);
    }
    let file = shard_file(dir, index, shards, per_unit);
    let (bytes, master) = shard_state(trainer)?;
    if !dir.is_dir() {
        return Err(RunError::Checkpoint(format!(
            "rank 0's checkpoint `{}` is not visible to this rank{}: with ZeRO or an offloaded optimizer every rank \
             writes its optimizer shard beside it, so --save must name a directory every process sees (a shared filesystem)",
            dir.display(),
            if writer { " (it wrote it)" } else { "" }
        )));
    }
    write_atomic(&file, &bytes)?;
    if let Some(m) = master {
        let bytes: Vec<u8> = m.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_atomic(&master_file(dir, index, shards), &bytes)?;
    }
    barrier(trainer.collective(), &device)
}

fn write_atomic(file: &Path, bytes: &[u8]) -> Result<(), RunError> {
    let tmp = file.with_extension(format!("tmp-{}", std::process::id()));
    let err =
        |e: std::io::Error| RunError::Checkpoint(format!("cannot write `{}`: {e}", file.display()));
    std::fs::write(&tmp, bytes).map_err(err)?;
    std::fs::rename(&tmp, file).map_err(err)
}

/// After `Trainer::resume(dir)`: this rank's optimizer shard from `dir`.
pub fn load_shard<B: ExecAutodiff>(trainer: &mut Trainer<B>, dir: &Path) -> Result<(), RunError> {
    let Some((index, shards, per_unit)) = this_shard(trainer) else {
        return Ok(());
    };
    let file = shard_file(dir, index, shards, per_unit);
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) => {
            let mut held: Vec<String> = std::fs::read_dir(dir)
                .map(|d| {
                    d.flatten()
                        .map(|f| f.file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with("optimizer-shard-"))
                        .collect()
                })
                .unwrap_or_default();
            held.sort();
            let first = held
                .first()
                .map(|n| format!(" (`{n}`, ...)"))
                .unwrap_or_default();
            return Err(RunError::Checkpoint(format!(
                "the checkpoint `{}` has no optimizer shard {index} of {shards}{} ({e}); it holds {} optimizer shard file(s){first}: \
                 resume with the ZeRO stage, offload and rank count it was saved with",
                dir.display(),
                if per_unit { " per unit (ZeRO-3)" } else { "" },
                held.len()
            )));
        }
    };
    trainer.load_optimizer_shard_state(&bytes)?;
    load_master(trainer, dir, index, shards)
}

/// The fp32 master shard `save_shard` wrote beside the optimizer shard,
/// when the weights do not give it back exactly.
fn load_master<B: ExecAutodiff>(
    trainer: &mut Trainer<B>,
    dir: &Path,
    index: usize,
    shards: usize,
) -> Result<(), RunError> {
    let kept = trainer.zero3().is_some_and(|z| z.master_kept())
        || trainer.zero().is_some_and(|z| z.master_kept());
    if !kept {
        return Ok(());
    }
    let file = master_file(dir, index, shards);
    let bytes = std::fs::read(&file).map_err(|e| {
        RunError::Checkpoint(format!(
            "the checkpoint `{}` has no fp32 master shard {index} of {shards} ({e}): \
             resume with the precision and offload it was saved with",
            dir.display()
        ))
    })?;
    if bytes.len() % 4 != 0 {
        return Err(RunError::Checkpoint(format!(
            "`{}` is cut short ({} bytes, not whole f32 values)",
            file.display(),
            bytes.len()
        )));
    }
    let values = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let device = trainer.device.clone();
    if let Some(z) = trainer.zero3_mut() {
        return z.load_master_state(values);
    }
    match trainer.zero_mut() {
        Some(z) => z.load_master_state(values, &device),
        None => Ok(()),
    }
}
