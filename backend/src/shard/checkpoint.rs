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
//! how many shards it holds. ZeRO-3 and parameter offload (weights sharded
//! too) are still refused by `execute`.

use crate::distributed::Collective;
use crate::ops::ExecAutodiff;
use crate::train::Trainer;
use crate::RunError;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use std::path::{Path, PathBuf};

/// Where shard `index` of `shards` lives in checkpoint `dir`.
pub fn shard_file(dir: &Path, index: usize, shards: usize) -> PathBuf {
    dir.join(format!("optimizer-shard-{index}-of-{shards}.bin"))
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
    let Some(z) = trainer.zero() else {
        return Ok(());
    };
    let device = trainer.device.clone();
    barrier(trainer.collective(), &device)?;
    let bytes = z.optimizer().save_state()?;
    let file = shard_file(dir, z.index(), z.shards());
    if !dir.is_dir() {
        return Err(RunError::Checkpoint(format!(
            "rank 0's checkpoint `{}` is not visible to this rank{}: with ZeRO or an offloaded optimizer every rank \
             writes its optimizer shard beside it, so --save must name a directory every process sees (a shared filesystem)",
            dir.display(),
            if writer { " (it wrote it)" } else { "" }
        )));
    }
    let tmp = file.with_extension(format!("tmp-{}", std::process::id()));
    let err =
        |e: std::io::Error| RunError::Checkpoint(format!("cannot write `{}`: {e}", file.display()));
    std::fs::write(&tmp, &bytes).map_err(err)?;
    std::fs::rename(&tmp, &file).map_err(err)?;
    barrier(trainer.collective(), &device)
}

/// After `Trainer::resume(dir)`: this rank's optimizer shard from `dir`.
pub fn load_shard<B: ExecAutodiff>(trainer: &mut Trainer<B>, dir: &Path) -> Result<(), RunError> {
    let Some(z) = trainer.zero() else {
        return Ok(());
    };
    let (index, shards) = (z.index(), z.shards());
    let file = shard_file(dir, index, shards);
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) => {
            let held = std::fs::read_dir(dir)
                .map(|d| {
                    d.flatten()
                        .filter(|f| {
                            f.file_name()
                                .to_string_lossy()
                                .starts_with("optimizer-shard-")
                        })
                        .count()
                })
                .unwrap_or(0);
            return Err(RunError::Checkpoint(format!(
                "the checkpoint `{}` has no optimizer shard {index} of {shards} ({e}); it holds {held} optimizer shard file(s): \
                 resume with the ZeRO stage, offload and rank count it was saved with",
                dir.display()
            )));
        }
    };
    trainer.load_optimizer_shard_state(&bytes)
}
