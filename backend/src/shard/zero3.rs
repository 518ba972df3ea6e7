//! ZeRO-3 and parameter offload: the weights at rest are flat shards, and
//! the step gathers each unit (the embedding, each layer, the head) for its
//! forward and again for a checkpointed layer's recomputation, then reduces
//! the unit's gradient as the backward leaves it (`UnitHooks`, called by
//! `Trainer::micro_step_with`). The shards are cut at start-up a unit at a
//! time (`Builder`, fed by `crate::setup`), so no rank holds the whole model.
//!
//! Two shard counts, each 1 or the run's `ranks`:
//! - `wshards`, the weights at rest: `ranks` with ZeRO-3, else 1 (every rank
//!   holds all of them: parameter offload without ZeRO-3);
//! - `oshards`, the gradient accumulator, the fp32 master and the optimizer
//!   state: `ranks` with ZeRO 1, 2 or 3, else 1.
//!
//! Every unit's trainable values (fp32 gradient, master, optimizer state)
//! are flattened in the unit's visit order and padded to `oshards` equal
//! shards; its frozen values (LoRA's base) are sharded beside them but never
//! stepped. A rank's shards of all units are concatenated: one flat
//! optimizer (`crate::optim::FlatOptim`) steps them, and nothing is gathered
//! after the step (with `wshards` = 1 and `oshards` = `ranks`, ZeRO 1 or 2
//! with parameter offload, the updated shards are gathered into the
//! host-resident weights).
//!
//! The gradient of unit u leaves the backward once per micro-batch: ZeRO 2
//! and 3 reduce-scatter it (mean over the ranks), ZeRO 1 all-reduces it and
//! keeps its shard, ZeRO 0 all-reduces it whole; only the shard is added to
//! the accumulator. With tied embeddings the head gathers the embedding unit
//! again and reduces that copy's gradient separately.
//!
//! The next unit's all-gather runs on a helper thread while this unit
//! computes (`Collective::start_all_gather`): every rank issues the same
//! gathers in the same order (`schedule`), and a pending gather is waited
//! for before any other collective call, so one rank never has two calls
//! under way.
//!
//! QLoRA's frozen NF4 base (no float parameter: Burn's visitors never see
//! it) is sharded beside the unit's values when the weights are (ZeRO-3 over
//! several ranks), as FSDP-QLoRA does: each layer's bases are encoded as one
//! stream of bytes (each base's packed codes, its scale codes, its fp32
//! scales' bits, [`encode_nf4`]), carried four bytes to an f32 word by
//! reinterpreting the bits (`f32::from_bits`), and cut into equal shards of
//! words. The layer's gather all-gathers its words after its float values
//! (a second call, never prefetched) and rebuilds the packed bases from the
//! words' bits; copies move bits unchanged and nothing computes with the
//! words, so the gathered base is the unsharded one bit for bit. The base
//! gets no gradient: nothing is reduced for it. The words come back through
//! host memory to be reinterpreted as bytes (Burn has no bit cast): a
//! round trip per use on a GPU, free on the CPU. With one weight shard the
//! layers keep their bases whole, as without ZeRO-3; parameter offload of a
//! QLoRA base is refused (`refuse_quantized_base`).
//!
//! With `offload = [params]` the weight shards and the fp32 master live in
//! host memory (fp32 there, whatever the storage dtype); a unit's shard is
//! uploaded right before its gather.
//!
//! With `offload = [optimizer]` and per-unit gathers (ZeRO-3 over more than
//! one rank, or the parameters offloaded) the gradient-shard accumulator is
//! in host memory beside the optimizer, as DeepSpeed's ZeRO-Offload keeps
//! it: each unit's reduced shard comes down as the backward leaves the
//! unit, so the device holds only the unit's transient gradient, and the
//! host optimizer steps from the accumulator. The compiler's `burn` profile
//! charges exactly this (`memory::burn_host_grad_accumulator`).

use super::layout::offloads;
use super::{flat_grads, host_threads, rank_place};
use crate::distributed::{Collective, Pending};
use crate::model::{Embed, Head, Layer, Model};
use crate::ops::ExecAutodiff;
use crate::optim::{to_host, FlatOptim, Place, Rule};
use crate::quant::base::Nf4Base;
use crate::quant::nf4::{DeviceScales, Nf4Tensor, Nf4Weight, Scales};
use crate::train::{Unit, UnitHooks};
use crate::RunError;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Int, Shape, Tensor, TensorData};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{Loss, OffloadWhat};

/// One parameter of a unit, in visit order.
struct ParamInfo {
    id: ParamId,
    shape: Shape,
    trainable: bool,
}

/// Where a unit's values sit in the flat shards.
struct UnitLayout {
    params: Vec<ParamInfo>,
    /// Trainable and frozen values of the whole unit.
    t_len: usize,
    f_len: usize,
    /// Per weight shard (`wshards`), and this unit's offset in the rank's
    /// concatenated weight shards.
    t_ws: usize,
    f_ws: usize,
    t_woff: usize,
    f_woff: usize,
    /// Per optimizer shard (`oshards`), and the offset in the rank's
    /// concatenated optimizer shard.
    t_os: usize,
    t_ooff: usize,
    /// The unit's NF4 bases, sharded as words (empty: none, or kept whole).
    q: QuantLayout,
}

/// One NF4 base in a unit's encoded stream: its shape, how many bytes of
/// packed codes and scale codes and how many fp32 scales it holds.
#[derive(Clone, Debug, PartialEq)]
struct QuantInfo {
    shape: [usize; 2],
    packed: usize,
    codes: usize,
    floats: usize,
    /// Double quantization's offset (`None`: fp32 scales).
    offset: Option<f32>,
}

/// Where a unit's encoded NF4 bases sit in the rank's word shards.
#[derive(Clone, Debug, Default, PartialEq)]
struct QuantLayout {
    bases: Vec<QuantInfo>,
    /// Words of the whole unit, per weight shard, and this unit's offset in
    /// the rank's concatenated word shards.
    len: usize,
    ws: usize,
    woff: usize,
}

/// Bytes packed four to an f32 word by their bits, little-endian.
#[derive(Default)]
struct WordWriter {
    words: Vec<f32>,
    word: [u8; 4],
    n: usize,
}

impl WordWriter {
    fn push(&mut self, bytes: impl IntoIterator<Item = u8>) {
        for b in bytes {
            self.word[self.n] = b;
            self.n += 1;
            if self.n == 4 {
                self.words
                    .push(f32::from_bits(u32::from_le_bytes(self.word)));
                self.n = 0;
            }
        }
    }

    /// One more base: its packed codes, its scale codes, its fp32 scales.
    fn base(&mut self, b: &Nf4Weight) -> QuantInfo {
        let (codes, floats, offset): (&[u8], &[f32], _) = match &b.scales {
            Scales::Fp32(a) => (&[], a, None),
            Scales::Double {
                codes,
                absmax2,
                offset,
            } => (codes, absmax2, Some(*offset)),
        };
        self.push(b.packed.iter().copied());
        self.push(codes.iter().copied());
        self.push(floats.iter().flat_map(|f| f.to_le_bytes()));
        QuantInfo {
            shape: b.shape,
            packed: b.packed.len(),
            codes: codes.len(),
            floats: floats.len(),
            offset,
        }
    }

    /// The words, the last padded with zero bytes.
    fn finish(mut self) -> Vec<f32> {
        if self.n > 0 {
            self.push(std::iter::repeat_n(0, 4 - self.n));
        }
        self.words
    }
}

/// `bases` as one stream of bytes (per base: packed codes, scale codes,
/// fp32 scales little-endian), four bytes to a word by their bits, the
/// last word padded with zero bytes.
#[cfg(test)]
fn encode_nf4(bases: &[Nf4Weight]) -> (Vec<QuantInfo>, Vec<f32>) {
    let mut w = WordWriter::default();
    let infos = bases.iter().map(|b| w.base(b)).collect();
    (infos, w.finish())
}

/// The bases [`encode_nf4`] wrote into `words` (which may run longer),
/// each handed to `each` as soon as it is read: the bytes are read off the
/// words in place, so no copy of the whole stream is made.
fn decode_nf4_each(
    infos: &[QuantInfo],
    words: &[f32],
    mut each: impl FnMut(Nf4Weight) -> Result<(), RunError>,
) -> Result<(), RunError> {
    let total = 4 * words.len();
    let byte = |i: usize| words[i / 4].to_bits().to_le_bytes()[i % 4];
    let mut at = 0;
    let mut span = |n: usize| -> Result<std::ops::Range<usize>, RunError> {
        if at + n > total {
            return Err(RunError::Backend(format!(
                "ZeRO-3: a gathered NF4 base ends at byte {total}, its layout needs {}",
                at + n
            )));
        }
        at += n;
        Ok(at - n..at)
    };
    for i in infos {
        let blocks = (i.shape[0] * i.shape[1]).div_ceil(crate::quant::nf4::BLOCK);
        // Room for the device's padding to whole blocks (`into_device`).
        let mut packed = Vec::with_capacity(i.packed.max(blocks * crate::quant::nf4::BLOCK / 2));
        packed.extend(span(i.packed)?.map(byte));
        let codes: Vec<u8> = span(i.codes)?.map(byte).collect();
        let fl = span(4 * i.floats)?;
        let floats: Vec<f32> = (0..i.floats)
            .map(|k| {
                let b = fl.start + 4 * k;
                f32::from_le_bytes([byte(b), byte(b + 1), byte(b + 2), byte(b + 3)])
            })
            .collect();
        let scales = match i.offset {
            None => Scales::Fp32(floats),
            Some(offset) => Scales::Double {
                codes,
                absmax2: floats,
                offset,
            },
        };
        let w = Nf4Weight {
            packed,
            scales,
            shape: i.shape,
        };
        w.validate()
            .map_err(|e| RunError::Backend(format!("ZeRO-3: a gathered NF4 base: {e}")))?;
        each(w)?;
    }
    Ok(())
}

/// [`decode_nf4_each`], collected.
#[cfg(test)]
fn decode_nf4(infos: &[QuantInfo], words: &[f32]) -> Result<Vec<Nf4Weight>, RunError> {
    let mut out = Vec::new();
    decode_nf4_each(infos, words, |w| {
        out.push(w);
        Ok(())
    })?;
    Ok(out)
}

/// An NF4 base holding nothing but its shape: what a layer of the skeleton
/// keeps while its base is sharded (its element count is still reported).
fn empty_nf4<I: Backend>(shape: [usize; 2], device: &I::Device) -> Nf4Tensor<I> {
    Nf4Tensor {
        packed: Tensor::<I, 1, Int>::from_data(
            TensorData::new(Vec::<u8>::new(), [0]),
            (device, DType::U8),
        ),
        scales: DeviceScales::Fp32(Tensor::zeros([0], device)),
        shape,
    }
}

/// The NF4 bases of `layer` encoded as words ([`WordWriter`]), read back
/// from the device one at a time.
fn nf4_words<B: Backend>(layer: &Layer<B>) -> Result<(Vec<QuantInfo>, Vec<f32>), RunError> {
    let mut w = WordWriter::default();
    let mut infos = Vec::new();
    for b in layer.linears().filter_map(|l| l.nf4()) {
        let host =
            b.w.to_host()
                .map_err(|e| RunError::Backend(format!("ZeRO-3: reading an NF4 base: {e}")))?;
        infos.push(w.base(&host));
    }
    Ok((infos, w.finish()))
}

/// A rank's flat values on the device: one tensor, or one per unit as the
/// per-unit build left them (concatenated in unit order), until the first
/// optimizer step needs them whole.
struct Flat<I: Backend> {
    parts: Vec<Tensor<I, 1>>,
    /// Where each part starts in the concatenation.
    starts: Vec<usize>,
    len: usize,
}

impl<I: Backend> Flat<I> {
    fn whole(t: Tensor<I, 1>) -> Self {
        let len = t.dims()[0];
        Flat {
            parts: vec![t],
            starts: vec![0],
            len,
        }
    }

    fn empty() -> Self {
        Flat {
            parts: Vec::new(),
            starts: Vec::new(),
            len: 0,
        }
    }

    fn push(&mut self, t: Tensor<I, 1>) {
        let n = t.dims()[0];
        if n > 0 {
            self.starts.push(self.len);
            self.parts.push(t);
            self.len += n;
        }
    }

    /// `range`, which lies within one part (a unit's, or the whole).
    fn slice(&self, range: std::ops::Range<usize>) -> Tensor<I, 1> {
        let p = self.starts.partition_point(|&s| s <= range.start).max(1) - 1;
        let at = self.starts[p];
        self.parts[p]
            .clone()
            .slice(range.start - at..range.end - at)
    }

    /// The values as one tensor (the parts concatenated once, then kept so).
    fn make_whole(&mut self, device: &I::Device) -> Tensor<I, 1> {
        if self.parts.len() != 1 {
            let parts = std::mem::take(&mut self.parts);
            *self = Flat::whole(super::cat_or_empty(parts, device));
        }
        self.parts[0].clone()
    }

    fn to_host(&self) -> Result<Vec<f32>, RunError> {
        let mut out = Vec::with_capacity(self.len);
        for p in &self.parts {
            out.extend(to_host(p.clone())?);
        }
        Ok(out)
    }
}

/// Flat values on the device (storage dtype) or in host memory (fp32).
enum Vals<I: Backend> {
    Device(Flat<I>),
    Host(Vec<f32>),
}

impl<I: Backend> Vals<I> {
    fn place(t: Tensor<I, 1>, host: bool) -> Result<Self, RunError> {
        Ok(if host {
            Vals::Host(to_host(t)?)
        } else {
            Vals::Device(Flat::whole(t))
        })
    }

    fn new(host: bool) -> Self {
        if host {
            Vals::Host(Vec::new())
        } else {
            Vals::Device(Flat::empty())
        }
    }

    /// Append shard `index` of `shards` of one unit's values (`pieces`,
    /// fp32, in order) in `dtype`: on the device in a buffer of its own; to
    /// the host a piece at a time, so the device never holds the shard.
    fn push_shard(
        &mut self,
        pieces: &[Tensor<I, 1>],
        (shards, index): (usize, usize),
        dtype: FloatDType,
        device: &I::Device,
    ) -> Result<(), RunError> {
        // One device buffer of the shard for either place. The host path once read each
        // piece's slice view back instead: on CUDA (fusion on) that failed at the first unit
        // with CUDA_ERROR_INVALID_VALUE in a kernel launch, while the device path ran (H100,
        // 2026-11-25, bench/h100-results/2026-11-25/call3). For the host the buffer is one
        // unit's shard, for as long as the copy takes.
        let shard = crate::model::to_dtype(shard_of(pieces, shards, index, device), dtype);
        match self {
            Vals::Device(f) => f.push(shard),
            Vals::Host(v) => v.extend(to_host(shard)?),
        }
        Ok(())
    }

    /// `range` on the device in `dtype` (uploaded from the host, through
    /// one buffer of the range's size).
    fn slice(
        &self,
        range: std::ops::Range<usize>,
        dtype: FloatDType,
        device: &I::Device,
    ) -> Tensor<I, 1> {
        match self {
            Vals::Device(f) => f.slice(range),
            Vals::Host(v) => {
                let n = range.len();
                let t = Tensor::<I, 1>::from_data(TensorData::new(v[range].to_vec(), [n]), device);
                crate::model::to_dtype(t, dtype)
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Vals::Device(f) => f.len,
            Vals::Host(v) => v.len(),
        }
    }
}

/// The fp32 master of this rank's optimizer shard.
enum Master<I: Backend> {
    /// The weight shard itself (same layout, fp32 or no master wanted, and
    /// where the optimizer reads it).
    Work,
    Device(Flat<I>),
    Host(Vec<f32>),
}

/// This rank's accumulated fp32 gradient shards.
enum Grads<I: Backend> {
    /// Per unit, on the device.
    Device(Vec<Option<Tensor<I, 1>>>),
    /// The rank's concatenated optimizer shard in host memory (every unit
    /// at its `t_ooff`), zero between steps.
    Host(Vec<f32>),
}

/// A unit's gathered weights: trainable and frozen values, whole.
type Gathered<I> = (Tensor<I, 1>, Tensor<I, 1>);

/// ZeRO-3 / parameter offload state of one rank.
pub struct Zero3<I: Backend> {
    stage: u8,
    ranks: usize,
    wshards: usize,
    oshards: usize,
    /// This rank's shard index (burn-collective's numbering).
    index: usize,
    units: Vec<UnitLayout>,
    layers: usize,
    /// Dtype of the gathered weights (the plan's `params`).
    storage: FloatDType,
    params_on_host: bool,
    work: Vals<I>,
    frozen: Vals<I>,
    /// This rank's shards of the encoded NF4 bases (QLoRA), on the device.
    quant: Flat<I>,
    master: Master<I>,
    optim: FlatOptim<I>,
    acc: Grads<I>,
    /// The head reads the embedding's table.
    tied: bool,
    /// Units gathered in this micro-batch, in order, and the next one.
    schedule: Vec<usize>,
    pos: usize,
    ready: Option<(usize, Gathered<I>)>,
    pending: Option<(usize, Pending<Tensor<I, 1>>)>,
    device: I::Device,
}

/// What the [`Builder`] needs to know about the run's precision.
pub struct Storage {
    /// Dtype the weights are stored (and gathered) in.
    pub dtype: FloatDType,
    /// An fp32 master is stepped (16-bit `dtype`).
    pub master: bool,
}

/// Whether `plan` streams its weights per unit (ZeRO-3, or the parameters
/// offloaded to host memory), or steps per unit without streaming them
/// (gradient offload: each unit's gradient leaves for the host accumulator
/// as the backward leaves the unit; with one weight shard on the device the
/// unit's parameters are views of the rank's flat weights, nothing is
/// gathered).
pub fn wanted(plan: &LoweredPlan) -> bool {
    let r = &plan.resolved;
    r.zero >= 3 || offloads(plan, OffloadWhat::Params) || offloads(plan, OffloadWhat::Grads)
}

/// QLoRA's frozen NF4 base is sharded with ZeRO-3 (see the module header)
/// but never moved to host memory: with parameter offload every rank would
/// keep it whole on the device, which the compiler's `burn` profile charges
/// on the host, so such a plan would be predicted below what a rank holds:
/// refused before anything is built.
pub fn refuse_quantized_base(plan: &LoweredPlan) -> Result<(), RunError> {
    let qlora = plan
        .adapter
        .as_ref()
        .is_some_and(|a| a.kind == rcoa_compiler::spec::AdapterKind::Qlora);
    if qlora && offloads(plan, OffloadWhat::Params) {
        return Err(RunError::Unsupported(
            "QLoRA with the parameters offloaded: the Burn executor keeps the NF4 base on the device (sharded \
             with ZeRO-3, whole otherwise), never in host memory, which the plan's prediction does not charge; \
             drop `params` from `offload` (`offload = [optimizer]` and `zero = 3` are executed)"
                .into(),
        ));
    }
    Ok(())
}

/// Whether a rank keeps an fp32 master apart from its weight shards: they
/// are cut otherwise (`wshards` vs `oshards`), 16-bit with a master, or on
/// the device while the optimizer is on the host. On the host when either
/// is offloaded (`params_host`, `opt_host`).
pub(crate) fn master_separate(
    wshards: usize,
    oshards: usize,
    storage: &Storage,
    params_host: bool,
    opt_host: bool,
) -> bool {
    !(wshards == oshards
        && (storage.dtype == FloatDType::F32 || !storage.master)
        && (params_host || !opt_host))
}

/// Builds one rank's ZeRO-3 / parameter-offload state a unit at a time:
/// each unit handed to `add` (whole, fp32, equal on every rank) is cut into
/// this rank's shards, which go straight to their place (device or host, in
/// the storage dtype), so only one whole unit exists at a time.
pub struct Builder<I: Backend> {
    stage: u8,
    ranks: usize,
    index: usize,
    local: usize,
    wshards: usize,
    oshards: usize,
    /// This rank's weight and optimizer shard indices.
    wi: usize,
    oi: usize,
    storage: Storage,
    host: bool,
    opt_host: bool,
    /// `offload = [grads]`: the gradient-shard accumulator in host memory.
    grads_host: bool,
    units: Vec<UnitLayout>,
    work: Vals<I>,
    frozen: Vals<I>,
    quant: Flat<I>,
    master: Option<Vals<I>>,
    device: Option<I::Device>,
}

impl<I: Backend> Builder<I> {
    /// `None` when `plan` keeps whole weights on the device.
    pub fn new(
        plan: &LoweredPlan,
        storage: Storage,
        collective: Option<&Collective<I>>,
    ) -> Result<Option<Self>, RunError> {
        if !wanted(plan) {
            return Ok(None);
        }
        refuse_quantized_base(plan)?;
        let stage = plan.resolved.zero;
        let (ranks, index, local) = rank_place(collective)?;
        let wshards = if stage >= 3 { ranks } else { 1 };
        let oshards = if stage >= 1 { ranks } else { 1 };
        if index >= ranks.max(1) {
            return Err(RunError::Collective(format!(
                "shard {index} of {ranks}: burn-collective numbered this rank outside the run"
            )));
        }
        let host = offloads(plan, OffloadWhat::Params);
        let opt_host = offloads(plan, OffloadWhat::Optimizer);
        let master_is_work = !master_separate(wshards, oshards, &storage, host, opt_host);
        Ok(Some(Builder {
            stage,
            ranks,
            index,
            local,
            wshards,
            oshards,
            wi: if wshards > 1 { index } else { 0 },
            oi: if oshards > 1 { index } else { 0 },
            storage,
            host,
            opt_host,
            grads_host: offloads(plan, OffloadWhat::Grads),
            units: Vec::new(),
            work: Vals::new(host),
            frozen: Vals::new(host),
            quant: Flat::empty(),
            master: (!master_is_work).then(|| Vals::new(opt_host || host)),
            device: None,
        }))
    }

    /// The next unit (embedding, each layer, head: forward order), whole
    /// and fp32: its layout and this rank's shards of it. The caller drops
    /// the unit afterwards.
    pub fn add<B: AutodiffBackend<InnerBackend = I>, M: Module<B>>(
        &mut self,
        unit: &M,
    ) -> Result<(), RunError> {
        let device = self
            .device
            .get_or_insert_with(|| first_device(unit))
            .clone();
        let (params, t, f) = unit_values::<B, M>(unit);
        let len = |v: &[Tensor<I, 1>]| v.iter().map(dims).sum::<usize>();
        let (t_len, f_len) = (len(&t), len(&f));
        let (t_ws, f_ws, t_os) = (
            t_len.div_ceil(self.wshards),
            f_len.div_ceil(self.wshards),
            t_len.div_ceil(self.oshards),
        );
        let (t_woff, f_woff, t_ooff) = match self.units.last() {
            Some(l) => (l.t_woff + l.t_ws, l.f_woff + l.f_ws, l.t_ooff + l.t_os),
            None => (0, 0, 0),
        };
        let dt = self.storage.dtype;
        let unit_no = self.units.len();
        let at = |what: &'static str| {
            move |e: RunError| match e {
                RunError::Backend(m) => RunError::Backend(format!(
                    "ZeRO-3 setup, unit {unit_no} (0: the embedding), {what}: {m}"
                )),
                e => e,
            }
        };
        if let Some(m) = &mut self.master {
            m.push_shard(&t, (self.oshards, self.oi), FloatDType::F32, &device)
                .map_err(at("fp32 master shard"))?;
        }
        let w = (self.wshards, self.wi);
        self.work
            .push_shard(&t, w, dt, &device)
            .map_err(at("trainable weight shard"))?;
        self.frozen
            .push_shard(&f, w, dt, &device)
            .map_err(at("frozen weight shard"))?;
        self.units.push(UnitLayout {
            params,
            t_len,
            f_len,
            t_ws,
            f_ws,
            t_woff,
            f_woff,
            t_os,
            t_ooff,
            q: QuantLayout::default(),
        });
        Ok(())
    }

    /// The NF4 bases (QLoRA) of `layer`, the unit just added: with several
    /// weight shards, this rank's shard of their encoded words is kept and
    /// the layer's bases are replaced by empty ones (so the skeleton holds
    /// none of them); with one, the layer keeps them whole.
    pub fn add_nf4<B: AutodiffBackend<InnerBackend = I>>(
        &mut self,
        layer: &mut Layer<B>,
    ) -> Result<(), RunError> {
        if self.wshards == 1 {
            return Ok(());
        }
        self.cut_nf4(nf4_words(layer)?)?;
        let device = self.device.clone().unwrap_or_default();
        for b in layer.nf4_bases_mut() {
            *b = Nf4Base::new(Nf4Tensor::from_inner(empty_nf4::<I>(b.w.shape, &device)));
        }
        Ok(())
    }

    fn cut_nf4(&mut self, (infos, mut words): (Vec<QuantInfo>, Vec<f32>)) -> Result<(), RunError> {
        if infos.is_empty() {
            return Ok(());
        }
        let device = self.device.clone().unwrap_or_default();
        let woff = self.units.iter().map(|u| u.q.ws).sum();
        let l = self
            .units
            .last_mut()
            .ok_or_else(|| RunError::Backend("ZeRO-3: NF4 bases before their unit".into()))?;
        let len = words.len();
        let ws = len.div_ceil(self.wshards);
        words.resize(ws * self.wshards, 0.0);
        let mine = words[self.wi * ws..(self.wi + 1) * ws].to_vec();
        drop(words);
        self.quant
            .push(Tensor::from_data(TensorData::new(mine, [ws]), &device));
        l.q = QuantLayout {
            bases: infos,
            len,
            ws,
            woff,
        };
        Ok(())
    }

    /// The rank's state once every unit was added.
    pub fn finish(self, plan: &LoweredPlan) -> Result<Zero3<I>, RunError> {
        let device = self.device.unwrap_or_default();
        let master = match self.master {
            None => Master::Work,
            Some(Vals::Host(v)) => Master::Host(v),
            Some(Vals::Device(f)) => Master::Device(f),
        };
        let place = if self.opt_host {
            Place::Host {
                threads: host_threads(self.local),
            }
        } else {
            Place::Device
        };
        let t_total = self.units.last().map_or(0, |l| l.t_ooff + l.t_os);
        // The compiler's condition (`memory::burn_host_grad_accumulator`): ZeRO-3
        // on one rank without parameter offload is charged as whole weights on
        // the device, its gradient there too, unless the plan offloads the
        // gradients (which it does only beside the optimizer).
        let acc = if self.opt_host && (self.host || self.wshards > 1 || self.grads_host) {
            Grads::Host(vec![0.0; t_total])
        } else {
            Grads::Device((0..self.units.len()).map(|_| None).collect())
        };
        Ok(Zero3 {
            stage: self.stage,
            ranks: self.ranks,
            wshards: self.wshards,
            oshards: self.oshards,
            index: self.index,
            layers: self.units.len().saturating_sub(2),
            storage: self.storage.dtype,
            params_on_host: self.host,
            acc,
            units: self.units,
            work: self.work,
            frozen: self.frozen,
            quant: self.quant,
            master,
            optim: FlatOptim::new(Rule::for_plan(plan)?, place, t_total),
            tied: plan.train.loss != Loss::Contrastive && plan.model.tie_embeddings,
            schedule: Vec::new(),
            pos: 0,
            ready: None,
            pending: None,
            device,
        })
    }
}

fn dims<I: Backend>(t: &Tensor<I, 1>) -> usize {
    t.dims()[0]
}

fn first_device<B: AutodiffBackend, M: Module<B>>(
    model: &M,
) -> burn::tensor::Device<B::InnerBackend> {
    struct Dev<D>(Option<D>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Dev<burn::tensor::Device<B::InnerBackend>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().inner().device());
            }
        }
    }
    let mut d = Dev(None);
    model.visit(&mut d);
    d.0.unwrap_or_default()
}

/// Shard `index` of the concatenation of `pieces`, padded to `shards` equal
/// parts: the slices of the pieces it covers, in order, and the zeros of
/// padding after them. The concatenation itself is never made.
fn shard_parts<I: Backend>(
    pieces: &[Tensor<I, 1>],
    shards: usize,
    index: usize,
) -> (Vec<Tensor<I, 1>>, usize) {
    let n: usize = pieces.iter().map(dims).sum();
    let per = n.div_ceil(shards);
    let (lo, hi) = ((index * per).min(n), ((index + 1) * per).min(n));
    let mut parts = Vec::new();
    let mut at = 0;
    for p in pieces {
        let len = dims(p);
        let (a, b) = (lo.max(at), hi.min(at + len));
        if a < b {
            parts.push(p.clone().slice(a - at..b - at));
        }
        at += len;
    }
    (parts, per - (hi - lo))
}

/// [`shard_parts`] in a buffer of its own on the device: no view that would
/// keep the pieces alive.
fn shard_of<I: Backend>(
    pieces: &[Tensor<I, 1>],
    shards: usize,
    index: usize,
    device: &I::Device,
) -> Tensor<I, 1> {
    let (mut parts, pad) = shard_parts(pieces, shards, index);
    // `cat` writes a new tensor (the padding's zeros at its end).
    parts.push(Tensor::zeros([pad], device));
    Tensor::cat(parts, 0)
}

/// A unit's parameters in visit order, and its trainable and frozen values,
/// fp32, one flat view per parameter (no copy of an fp32 parameter).
#[allow(clippy::type_complexity)]
fn unit_values<B: AutodiffBackend, M: Module<B>>(
    m: &M,
) -> (
    Vec<ParamInfo>,
    Vec<Tensor<B::InnerBackend, 1>>,
    Vec<Tensor<B::InnerBackend, 1>>,
) {
    struct Values<I: Backend> {
        params: Vec<ParamInfo>,
        t: Vec<Tensor<I, 1>>,
        f: Vec<Tensor<I, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let trainable = param.is_require_grad();
            let t = param.val().inner();
            self.params.push(ParamInfo {
                id: param.id,
                shape: t.shape(),
                trainable,
            });
            let flat = crate::model::to_dtype(t, FloatDType::F32).flatten(0, D - 1);
            if trainable {
                self.t.push(flat);
            } else {
                self.f.push(flat);
            }
        }
    }
    let mut v = Values {
        params: Vec::new(),
        t: Vec::new(),
        f: Vec::new(),
    };
    m.visit(&mut v);
    (v.params, v.t, v.f)
}

/// Replaces every parameter by a 1-element placeholder (id and
/// trainability kept): the skeleton whose units `Fill` rebuilds.
pub(crate) struct Placeholders;

impl<B: AutodiffBackend> ModuleMapper<B> for Placeholders {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, t, _) = param.consume();
        let trainable = t.is_require_grad();
        let device = t.device();
        drop(t);
        let p = Tensor::<B::InnerBackend, D>::zeros([1; D], &device);
        Param::initialized(id, Tensor::from_inner(p).set_require_grad(trainable))
    }
}

/// Rebuilds a unit from its skeleton with gathered values: every parameter
/// a fresh leaf (same id) in its shape, trainable ones tracked.
struct Fill<'a, I: Backend> {
    params: std::slice::Iter<'a, ParamInfo>,
    t: Option<Tensor<I, 1>>,
    f: Option<Tensor<I, 1>>,
    t_at: usize,
    f_at: usize,
    wrong: Option<String>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Fill<'_, B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(info) = self.params.next().filter(|i| i.id == param.id) else {
            self.wrong.get_or_insert_with(|| {
                format!("parameter {} is not in the unit's layout", param.id)
            });
            return param;
        };
        let n = info.shape.num_elements();
        let (src, at) = if info.trainable {
            (&self.t, &mut self.t_at)
        } else {
            (&self.f, &mut self.f_at)
        };
        let Some(src) = src else {
            self.wrong
                .get_or_insert_with(|| "a unit's values are missing".into());
            return param;
        };
        let part = src
            .clone()
            .slice(*at..*at + n)
            .reshape::<D, _>(info.shape.clone());
        *at += n;
        let t = Tensor::from_inner(part);
        Param::initialized(info.id, if info.trainable { t.require_grad() } else { t })
    }
}

impl<I: Backend> Zero3<I> {
    /// The ZeRO stage executed.
    pub fn stage(&self) -> u8 {
        self.stage
    }

    pub fn optimizer(&self) -> &FlatOptim<I> {
        &self.optim
    }

    pub fn optimizer_mut(&mut self) -> &mut FlatOptim<I> {
        &mut self.optim
    }

    /// This rank's optimizer shard: (index, count). A count of 1 (ZeRO 0
    /// with the parameters offloaded) means every rank holds all of it.
    pub fn optimizer_shard(&self) -> (usize, usize) {
        let oi = if self.oshards > 1 { self.index } else { 0 };
        (oi, self.oshards)
    }

    /// The fp32 master shard when it holds more than the weights give back
    /// (16-bit weights with an fp32 master, or a master on the host beside
    /// device weights); `None` when it is the weight shard or is derived
    /// from the weights exactly.
    pub fn master_state(&self) -> Result<Option<Vec<f32>>, RunError> {
        if !self.master_kept() {
            return Ok(None);
        }
        match &self.master {
            Master::Work => Ok(None),
            Master::Device(t) => Ok(Some(t.to_host()?)),
            Master::Host(v) => Ok(Some(v.clone())),
        }
    }

    /// Whether a checkpoint holds the master shard beside the optimizer
    /// state (`master_state`).
    pub fn master_kept(&self) -> bool {
        self.storage != FloatDType::F32 && !matches!(self.master, Master::Work)
    }

    /// Restore the master shard written by `master_state`.
    pub fn load_master_state(&mut self, values: Vec<f32>) -> Result<(), RunError> {
        let want = self.optim_len();
        if values.len() != want {
            return Err(RunError::Checkpoint(format!(
                "the fp32 master shard holds {} values, this rank's optimizer shard {want}: \
                 resume with the plan, ZeRO stage and rank count it was saved with",
                values.len()
            )));
        }
        match &mut self.master {
            Master::Work => {}
            Master::Device(t) => {
                *t = Flat::whole(Tensor::from_data(
                    TensorData::new(values, [want]),
                    &self.device,
                ));
            }
            Master::Host(v) => *v = values,
        }
        Ok(())
    }

    fn optim_len(&self) -> usize {
        self.units.last().map_or(0, |l| l.t_ooff + l.t_os)
    }

    /// The whole model's parameter shapes, in visit order (what a
    /// checkpoint's record must hold).
    pub fn param_shapes(&self) -> Vec<Vec<usize>> {
        self.units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.shape.to_vec()))
            .collect()
    }

    /// Replace this rank's weight shards and master by those of `model`
    /// (whole weights, cut as the [`Builder`] cuts them): resume's path. The
    /// optimizer state is untouched; the gradient accumulator is empty
    /// between steps.
    pub fn load_whole<B: ExecAutodiff<InnerBackend = I>>(
        &mut self,
        model: &Model<B>,
    ) -> Result<(), RunError> {
        if self.pending.is_some() {
            return Err(RunError::Backend(
                "ZeRO-3: weights replaced while a gather is under way".into(),
            ));
        }
        self.ready = None;
        let (oi, _) = self.optimizer_shard();
        // The same cut as the run's build: a builder with this rank's places.
        let host = self.params_on_host;
        let mut b = Builder {
            stage: self.stage,
            ranks: self.ranks,
            index: self.index,
            local: 1,
            wshards: self.wshards,
            oshards: self.oshards,
            wi: if self.wshards > 1 { self.index } else { 0 },
            oi,
            storage: Storage {
                dtype: self.storage,
                master: false,
            },
            host,
            opt_host: false,
            grads_host: false,
            units: Vec::new(),
            work: Vals::new(host),
            frozen: Vals::new(host),
            quant: Flat::empty(),
            master: match &self.master {
                Master::Work => None,
                Master::Host(_) => Some(Vals::new(true)),
                Master::Device(_) => Some(Vals::new(false)),
            },
            device: Some(self.device.clone()),
        };
        b.add::<B, _>(&model.embed)?;
        for l in &model.layers {
            b.add::<B, _>(l)?;
            if b.wshards > 1 {
                b.cut_nf4(nf4_words(l)?)?;
            }
        }
        b.add::<B, _>(&model.head)?;
        let same = b.units.len() == self.units.len()
            && b.units.iter().zip(&self.units).all(|(a, b)| {
                a.t_len == b.t_len
                    && a.f_len == b.f_len
                    && a.q == b.q
                    && a.params.len() == b.params.len()
                    && a.params
                        .iter()
                        .zip(&b.params)
                        .all(|(p, q)| p.shape == q.shape && p.trainable == q.trainable)
            });
        if !same {
            return Err(RunError::Checkpoint(
                "the checkpoint's model does not split into this plan's units (other shapes or trainable parameters)"
                    .into(),
            ));
        }
        self.master = match b.master {
            None => Master::Work,
            Some(Vals::Host(v)) => Master::Host(v),
            Some(Vals::Device(f)) => Master::Device(f),
        };
        self.work = b.work;
        self.frozen = b.frozen;
        self.quant = b.quant;
        Ok(())
    }

    pub fn params_on_host(&self) -> bool {
        self.params_on_host
    }

    /// Values in this rank's weight shards (trainable and frozen).
    pub fn weight_shard_len(&self) -> usize {
        self.work.len() + self.frozen.len()
    }

    /// Words (4 bytes each) in this rank's shards of the NF4 bases.
    pub fn nf4_shard_words(&self) -> usize {
        self.quant.len
    }

    /// Parameters of the whole model (all, trainable).
    pub fn param_counts(&self) -> (u64, u64) {
        let t: usize = self.units.iter().map(|u| u.t_len).sum();
        let f: usize = self.units.iter().map(|u| u.f_len).sum();
        ((t + f) as u64, t as u64)
    }

    /// Host bytes this rank holds: weight shards and master on the host
    /// (parameter offload), the optimizer state and the gradient shard
    /// (optimizer offload: the accumulator kept there, or the accumulated
    /// shard brought down for the step).
    pub fn host_bytes(&self) -> u64 {
        let mut values = 0;
        for v in [&self.work, &self.frozen] {
            if let Vals::Host(v) = v {
                values += v.len();
            }
        }
        if let Master::Host(m) = &self.master {
            values += m.len();
        }
        if let Place::Host { .. } = self.optim.place() {
            let t: usize = self.units.iter().map(|u| u.t_os).sum();
            values += (self.optim.rule().state_per_param() + 1) * t;
        }
        (values * 4) as u64
    }

    /// The gradient-shard accumulator is in host memory.
    pub fn grads_on_host(&self) -> bool {
        matches!(self.acc, Grads::Host(_))
    }

    fn unit_index(&self, u: Unit) -> usize {
        match u {
            Unit::Embed => 0,
            Unit::Layer(i) => i + 1,
            Unit::Head => self.layers + 1,
        }
    }

    /// Start a micro-batch: the units it will gather, in order.
    pub fn begin_micro(&mut self, checkpointed: &[bool]) {
        let n = self.layers;
        let mut s: Vec<usize> = (0..n + 2).collect();
        if self.tied {
            s.push(0);
        }
        s.extend(
            (0..n)
                .rev()
                .filter(|&i| checkpointed.get(i).copied().unwrap_or(false))
                .map(|i| i + 1),
        );
        self.schedule = s;
        self.pos = 0;
        self.ready = None;
        self.pending = None;
    }

    /// This rank's piece of unit `u` for the gather: its weight shards,
    /// trainable then frozen, in the storage dtype on the device.
    fn piece(&self, u: usize) -> Tensor<I, 1> {
        let l = &self.units[u];
        let mut parts = Vec::new();
        if l.t_ws > 0 {
            parts.push(
                self.work
                    .slice(l.t_woff..l.t_woff + l.t_ws, self.storage, &self.device),
            );
        }
        if l.f_ws > 0 {
            parts.push(
                self.frozen
                    .slice(l.f_woff..l.f_woff + l.f_ws, self.storage, &self.device),
            );
        }
        super::cat_or_empty(parts, &self.device)
    }

    /// Unit `u`'s values where they rest, whole (one weight shard): views
    /// of the device values, nothing concatenated (the profile charges
    /// such units nothing beside the weights), or uploaded from the host.
    fn in_place(&self, u: usize) -> Gathered<I> {
        let l = &self.units[u];
        let part = |v: &Vals<I>, off: usize, len: usize| {
            if len == 0 {
                Tensor::<I, 1>::zeros([0], &self.device)
            } else {
                v.slice(off..off + len, self.storage, &self.device)
            }
        };
        (
            part(&self.work, l.t_woff, l.t_len),
            part(&self.frozen, l.f_woff, l.f_len),
        )
    }

    /// Unit `u`'s whole values from every rank's piece (`all`:
    /// `wshards` pieces in shard order).
    fn split(&self, u: usize, all: Tensor<I, 1>) -> Gathered<I> {
        let l = &self.units[u];
        let s = self.wshards;
        let w = l.t_ws + l.f_ws;
        let empty = || Tensor::<I, 1>::zeros([0], &self.device);
        if w == 0 {
            return (empty(), empty());
        }
        let m = all.reshape([s, w]);
        let col = |from: usize, n: usize, len: usize| {
            if n == 0 {
                empty()
            } else {
                m.clone()
                    .slice([0..s, from..from + n])
                    .reshape([s * n])
                    .slice(0..len)
            }
        };
        (col(0, l.t_ws, l.t_len), col(l.t_ws, l.f_ws, l.f_len))
    }

    fn gather_now(&self, u: usize, c: Option<&Collective<I>>) -> Result<Gathered<I>, RunError> {
        if self.wshards == 1 {
            return Ok(self.in_place(u));
        }
        let piece = self.piece(u);
        let all = match c {
            Some(c) if dims(&piece) > 0 => c.all_gather(piece)?,
            _ => piece,
        };
        Ok(self.split(u, all))
    }

    /// Unit `u`'s NF4 bases, gathered from every rank's words and rebuilt
    /// on the device (none when the unit keeps them whole). Called with no
    /// other gather under way.
    fn gather_nf4(
        &self,
        u: usize,
        c: Option<&Collective<I>>,
    ) -> Result<Vec<Nf4Tensor<I>>, RunError> {
        let q = &self.units[u].q;
        if q.bases.is_empty() {
            return Ok(Vec::new());
        }
        let piece = self.quant.slice(q.woff..q.woff + q.ws);
        let all = match c {
            Some(c) if self.wshards > 1 => c.all_gather(piece)?,
            _ => piece,
        };
        // Read in place: the host bytes are the gathered tensor's, not a copy.
        let data = all.into_data();
        let words = data
            .as_slice::<f32>()
            .map_err(|e| RunError::Backend(format!("ZeRO-3: reading gathered NF4 words: {e:?}")))?;
        let mut out = Vec::with_capacity(q.bases.len());
        decode_nf4_each(&q.bases, &words[..q.len.min(words.len())], |w| {
            out.push(
                w.into_device::<I>(&self.device)
                    .map_err(|e| RunError::Backend(format!("ZeRO-3: a gathered NF4 base: {e}")))?,
            );
            Ok(())
        })?;
        Ok(out)
    }

    /// Wait for the gather under way, if any, before another collective
    /// call.
    fn settle(&mut self, c: Option<&Collective<I>>) -> Result<(), RunError> {
        if let Some((pos, p)) = self.pending.take() {
            let c = c.ok_or_else(|| RunError::Backend("a gather without a collective".into()))?;
            let all = c.finish_call(p)?;
            let u = self.schedule[pos];
            self.ready = Some((pos, self.split(u, all)));
        }
        Ok(())
    }

    /// Unit `u`'s gathered weights and NF4 bases: the next unit of the
    /// schedule. Starts the gather of the one after it.
    #[allow(clippy::type_complexity)]
    fn take(
        &mut self,
        u: Unit,
        c: Option<&Collective<I>>,
    ) -> Result<(Gathered<I>, Vec<Nf4Tensor<I>>), RunError> {
        let want = self.unit_index(u);
        let pos = self.pos;
        if self.schedule.get(pos) != Some(&want) {
            return Err(RunError::Backend(format!(
                "ZeRO-3 was asked for {u:?} out of its gather order ({:?} at {pos})",
                self.schedule
            )));
        }
        self.pos += 1;
        if self.pending.as_ref().is_some_and(|(p, _)| *p == pos) {
            self.settle(c)?;
        }
        let got = match self.ready.take() {
            Some((p, g)) if p == pos => g,
            _ => self.gather_now(want, c)?,
        };
        self.settle(c)?;
        let bases = self.gather_nf4(want, c)?;
        if let (Some(c), Some(&next)) = (c, self.schedule.get(self.pos)) {
            if self.wshards > 1 {
                let piece = self.piece(next);
                if dims(&piece) > 0 {
                    self.pending = Some((self.pos, c.start_all_gather(piece)?));
                }
            }
        }
        Ok((got, bases))
    }

    /// Add unit `u`'s gradient (`flat`: fp32, the unit's trainable values in
    /// visit order) to this rank's shard, reduced over the ranks.
    fn reduce(
        &mut self,
        u: usize,
        flat: Tensor<I, 1>,
        c: Option<&Collective<I>>,
    ) -> Result<(), RunError> {
        self.settle(c)?;
        let l = &self.units[u];
        if l.t_len == 0 {
            return Ok(());
        }
        let (s, per) = (self.oshards, l.t_os);
        let pad = |t: Tensor<I, 1>, to: usize| {
            let n = t.dims()[0];
            if to > n {
                Tensor::cat(vec![t, Tensor::zeros([to - n], &self.device)], 0)
            } else {
                t
            }
        };
        let shard = match c {
            Some(c) if s > 1 && self.stage >= 2 => {
                let (g, at) = c.reduce_scatter_mean(pad(flat, s * per))?;
                if at != self.index {
                    return Err(RunError::Collective(format!(
                        "the reduce-scatter gave this rank shard {at}, it owns {}",
                        self.index
                    )));
                }
                g
            }
            Some(c) if self.ranks > 1 => {
                // Whole (ZeRO 0 and 1), padded so burn-collective's ring can
                // cut it into one part per rank.
                let to = (s * per).div_ceil(self.ranks) * self.ranks;
                let all = c.mean(pad(flat, to))?;
                let at = if s > 1 { self.index } else { 0 };
                all.slice(at * per..(at + 1) * per)
            }
            _ => pad(flat, per),
        };
        match &mut self.acc {
            Grads::Device(acc) => {
                let acc = &mut acc[u];
                *acc = Some(match acc.take() {
                    Some(a) => a + shard,
                    None => shard,
                });
            }
            Grads::Host(acc) => {
                // Read back now: the device's copy is freed with `shard`.
                let g = to_host(shard)?;
                let at = l.t_ooff;
                self.optim.accumulate_host(&mut acc[at..at + per], &g)?;
            }
        }
        Ok(())
    }

    /// The optimizer step of this rank's shard with the accumulated
    /// gradient; returns the loss averaged over the ranks, and whether the
    /// optimizer stepped. With `unscale` (fp16's 1 / loss scale) the
    /// gradient is multiplied by it first, and where any rank's shard is not
    /// finite no rank steps (`crate::loss_scale`).
    pub fn step(
        &mut self,
        c: Option<&Collective<I>>,
        lr: f64,
        loss: Tensor<I, 1>,
        unscale: Option<f64>,
    ) -> Result<(Tensor<I, 1>, bool), RunError> {
        self.settle(c)?;
        self.ready = None;
        let loss = loss.cast(FloatDType::F32);
        let upload = |v: &[f32], device: &I::Device| {
            Tensor::<I, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device)
        };
        let device = self.device.clone();
        // The loss averaged over the ranks, and whether every rank's gradient is
        // finite: a rank's check rides the loss's all-reduce.
        let ranks = self.ranks;
        let exchange = |loss, check| -> Result<(Tensor<I, 1>, bool), RunError> {
            let (loss, check) = match c {
                Some(c) if ranks > 1 => super::mean_loss_and_flag(c, loss, check)?,
                _ => (loss, check),
            };
            Ok((loss, crate::loss_scale::may_step(check)))
        };
        let acc = match &mut self.acc {
            Grads::Device(acc) => acc,
            Grads::Host(g) => {
                // Divided by the loss scale here, in place, and checked in the same pass.
                let check = match unscale {
                    Some(inv) => Some(crate::loss_scale::host_flag(
                        self.optim.unscale_host(g, inv)?,
                        &device,
                    )),
                    None => None,
                };
                let (loss, finite) = exchange(loss, check)?;
                // The host optimizer reads the host accumulator: nothing
                // comes down. Skipped, the weights stay.
                let updated = match (&mut self.master, &mut self.work) {
                    _ if !finite => None,
                    (Master::Work, Vals::Host(w)) => {
                        self.optim.step_host_grad(lr, w, g)?;
                        None
                    }
                    (Master::Host(m), _) => {
                        self.optim.step_host_grad(lr, m, g)?;
                        Some(upload(m, &device))
                    }
                    _ => {
                        return Err(RunError::Backend(
                            "ZeRO-3: a host gradient accumulator without a host master".into(),
                        ))
                    }
                };
                g.fill(0.0);
                return Ok((self.finish_step(c, updated, loss)?, finite));
            }
        };
        let parts: Vec<Tensor<I, 1>> = self
            .units
            .iter()
            .zip(acc.iter_mut())
            .filter(|(l, _)| l.t_os > 0)
            .map(|(l, a)| a.take().unwrap_or_else(|| Tensor::zeros([l.t_os], &device)))
            .collect();
        let grad = super::cat_or_empty(parts, &device);
        // The optimizer divides it by the loss scale.
        let (loss, finite) = exchange(loss, crate::loss_scale::scaled_check(&grad, unscale))?;
        if !finite {
            // Skipped: the accumulated gradient goes, the weights stay.
            return Ok((self.finish_step(c, None, loss)?, false));
        }
        // The updated fp32 shard on the device; `None`: the host weights
        // were updated in place.
        let updated = match (&mut self.master, self.optim.place(), &mut self.work) {
            (Master::Work, Place::Host { .. }, Vals::Host(w)) => {
                self.optim.step_host_master(lr, w, grad, unscale)?;
                None
            }
            (Master::Work, Place::Device, Vals::Device(w)) => {
                let w = w.make_whole(&device);
                Some(
                    self.optim
                        .step(lr, w.cast(FloatDType::F32), grad, unscale)?,
                )
            }
            (Master::Work, Place::Device, Vals::Host(w)) => {
                let u = self.optim.step(lr, upload(w, &device), grad, unscale)?;
                *w = to_host(u)?;
                None
            }
            (Master::Device(m), Place::Device, _) => {
                let u = self.optim.step(lr, m.make_whole(&device), grad, unscale)?;
                *m = Flat::whole(u.clone());
                Some(u)
            }
            (Master::Host(m), Place::Host { .. }, _) => {
                Some(self.optim.step_host_master(lr, m, grad, unscale)?)
            }
            (Master::Host(m), Place::Device, _) => {
                let u = self.optim.step(lr, upload(m, &device), grad, unscale)?;
                *m = to_host(u.clone())?;
                Some(u)
            }
            _ => {
                return Err(RunError::Backend(
                    "ZeRO-3: the master shard is not where the optimizer reads it".into(),
                ))
            }
        };
        Ok((self.finish_step(c, updated, loss)?, true))
    }

    /// After the optimizer: `updated` (this rank's new fp32 shard on the
    /// device; `None`: the host weights were updated in place) becomes the
    /// weights at rest.
    fn finish_step(
        &mut self,
        c: Option<&Collective<I>>,
        updated: Option<Tensor<I, 1>>,
        loss: Tensor<I, 1>,
    ) -> Result<Tensor<I, 1>, RunError> {
        let Some(updated) = updated else {
            return Ok(loss);
        };
        let same_layout = self.wshards == self.oshards;
        if matches!(self.master, Master::Work) || same_layout && self.storage == FloatDType::F32 {
            // The update is the new resting shard as it is (no gather, no cast, or the
            // weights are the device optimizer's master and stay whole for its step).
            self.work = Vals::place(
                crate::model::to_dtype(updated, self.storage),
                self.params_on_host,
            )?;
            return Ok(loss);
        }
        // The old weights are not read again before the next forward: freed first, the
        // new ones take their place a unit at a time, each cast to the storage dtype and,
        // with more optimizer shards than weight shards (ZeRO 1/2, every rank holding all
        // the weights), all-gathered in it. What exists beside the weights is one unit's
        // values, never a whole fp32 model.
        self.work = Vals::new(self.params_on_host);
        let gather = match c {
            _ if same_layout => None,
            Some(c) => Some(c),
            None => return Err(RunError::Backend("sharded without a collective".into())),
        };
        for l in self.units.iter().filter(|l| l.t_os > 0) {
            let mine = crate::model::to_dtype(
                updated.clone().slice(l.t_ooff..l.t_ooff + l.t_os),
                self.storage,
            );
            let values = match gather {
                Some(c) => c.all_gather(mine)?.slice(0..l.t_len),
                None => mine,
            };
            match &mut self.work {
                Vals::Device(f) => f.push(values),
                Vals::Host(v) => v.extend(to_host(values)?),
            }
        }
        Ok(loss)
    }

    /// Gather every unit (outside a micro-batch) and rebuild the whole
    /// model from `skeleton`: for checksums and comparisons at the end.
    pub fn gather_model<B: AutodiffBackend<InnerBackend = I>>(
        &mut self,
        skeleton: &Model<B>,
        c: Option<&Collective<I>>,
    ) -> Result<Model<B>, RunError> {
        self.settle(c)?;
        self.ready = None;
        let embed = self.build(0, skeleton.embed.clone(), self.gather_now(0, c)?)?;
        let mut layers = Vec::new();
        for (i, l) in skeleton.layers.iter().enumerate() {
            let mut l = self.build(i + 1, l.clone(), self.gather_now(i + 1, c)?)?;
            put_nf4(&mut l, self.gather_nf4(i + 1, c)?)?;
            layers.push(l);
        }
        let h = self.layers + 1;
        let head = self.build(h, skeleton.head.clone(), self.gather_now(h, c)?)?;
        Ok(Model {
            embed,
            layers,
            head,
        })
    }

    fn build<B: AutodiffBackend<InnerBackend = I>, M: Module<B>>(
        &self,
        u: usize,
        skeleton: M,
        (t, f): Gathered<I>,
    ) -> Result<M, RunError> {
        let l = &self.units[u];
        let mut fill = Fill {
            params: l.params.iter(),
            t: (l.t_len > 0).then_some(t),
            f: (l.f_len > 0).then_some(f),
            t_at: 0,
            f_at: 0,
            wrong: None,
        };
        let m = skeleton.map(&mut fill);
        match fill.wrong {
            Some(w) => Err(RunError::Backend(format!(
                "ZeRO-3 cannot rebuild a unit: {w}"
            ))),
            None => Ok(m),
        }
    }
}

/// `UnitHooks` of one micro-batch of a ZeRO-3 / parameter-offload rank: the
/// gathered units it handed out, kept until their backward.
pub struct Zero3Hooks<'a, B: ExecAutodiff> {
    zero: &'a mut Zero3<B::InnerBackend>,
    skeleton: &'a Model<B>,
    collective: Option<&'a Collective<B::InnerBackend>>,
    embed: Option<Embed<B>>,
    layers: Vec<Option<Layer<B>>>,
    head: Option<(Head<B>, Option<Embed<B>>)>,
}

impl<'a, B: ExecAutodiff> Zero3Hooks<'a, B> {
    pub fn new(
        zero: &'a mut Zero3<B::InnerBackend>,
        skeleton: &'a Model<B>,
        collective: Option<&'a Collective<B::InnerBackend>>,
        checkpointed: &[bool],
    ) -> Self {
        zero.begin_micro(checkpointed);
        Zero3Hooks {
            layers: (0..skeleton.layers.len()).map(|_| None).collect(),
            zero,
            skeleton,
            collective,
            embed: None,
            head: None,
        }
    }

    fn reduce_module<M: burn::module::AutodiffModule<B>>(
        &mut self,
        u: usize,
        m: &M,
        grads: &mut B::Gradients,
    ) -> Result<(), RunError> {
        let mut gp = GradientsParams::from_module(grads, m);
        let flat = flat_grads::<B, M>(m, &mut gp, &self.zero.device);
        self.zero.reduce(u, flat, self.collective)
    }
}

impl<B: ExecAutodiff> UnitHooks<B> for Zero3Hooks<'_, B> {
    type Error = RunError;

    fn embed(&mut self) -> Result<Embed<B>, RunError> {
        let (g, _) = self.zero.take(Unit::Embed, self.collective)?;
        let e = self.zero.build(0, self.skeleton.embed.clone(), g)?;
        self.embed = Some(e.clone());
        Ok(e)
    }

    fn layer(&mut self, i: usize, keep: bool) -> Result<Layer<B>, RunError> {
        let (g, bases) = self.zero.take(Unit::Layer(i), self.collective)?;
        let mut l = self.zero.build(i + 1, self.skeleton.layers[i].clone(), g)?;
        put_nf4(&mut l, bases)?;
        // A checkpointed layer's forward keeps nothing: its weights go
        // with the caller's copy.
        self.layers[i] = keep.then(|| l.clone());
        Ok(l)
    }

    fn head(&mut self) -> Result<(Head<B>, Embed<B>), RunError> {
        let h = self.zero.layers + 1;
        let (g, _) = self.zero.take(Unit::Head, self.collective)?;
        let head = self.zero.build(h, self.skeleton.head.clone(), g)?;
        let tied = if self.zero.tied {
            let (g, _) = self.zero.take(Unit::Embed, self.collective)?;
            Some(self.zero.build(0, self.skeleton.embed.clone(), g)?)
        } else {
            None
        };
        self.head = Some((head.clone(), tied.clone()));
        // Untied, the head never reads the embedding: the skeleton's stands in.
        Ok((head, tied.unwrap_or_else(|| self.skeleton.embed.clone())))
    }

    fn backward(&mut self, unit: Unit, mut grads: B::Gradients) -> Result<(), RunError> {
        match unit {
            Unit::Embed => {
                let e = self.embed.take().ok_or_else(|| lost(unit))?;
                self.reduce_module(0, &e, &mut grads)
            }
            Unit::Layer(i) => {
                let l = self.layers[i].take().ok_or_else(|| lost(unit))?;
                self.reduce_module(i + 1, &l, &mut grads)
            }
            Unit::Head => {
                let (head, tied) = self.head.take().ok_or_else(|| lost(unit))?;
                self.reduce_module(self.zero.layers + 1, &head, &mut grads)?;
                match tied {
                    Some(e) => self.reduce_module(0, &e, &mut grads),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Put a layer's gathered NF4 `bases` (in construction order) in place of
/// the skeleton's empty ones; none: the layer kept its own.
fn put_nf4<B: AutodiffBackend>(
    layer: &mut Layer<B>,
    bases: Vec<Nf4Tensor<B::InnerBackend>>,
) -> Result<(), RunError> {
    if bases.is_empty() {
        return Ok(());
    }
    let mut slots: Vec<_> = layer.nf4_bases_mut().collect();
    if slots.len() != bases.len() {
        return Err(RunError::Backend(format!(
            "ZeRO-3 gathered {} NF4 bases for a layer of {}",
            bases.len(),
            slots.len()
        )));
    }
    for (slot, b) in slots.iter_mut().zip(bases) {
        **slot = Nf4Base::new(Nf4Tensor::from_inner(b));
    }
    Ok(())
}

fn lost(u: Unit) -> RunError {
    RunError::Backend(format!(
        "ZeRO-3: the backward of {u:?} came without its forward's weights"
    ))
}

#[cfg(test)]
#[path = "zero3_nf4_memory.rs"]
mod nf4_memory;

#[cfg(test)]
mod tests {
    use super::*;
    use rcoa_compiler::spec::{AdapterKind, AdapterSpec, Dtype, Offload, OffloadTo, Proj};

    /// Bases quantized from values that include every bit pattern a scale
    /// could take come back from their words bit for bit, through a cut
    /// into shards and their concatenation (what the all-gather does),
    /// with fp32 and with double-quantized scales, of odd sizes.
    #[test]
    fn encoded_nf4_bases_come_back_bit_for_bit() {
        let values = |n: usize, k: u32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 * 0.37 + k as f32).sin() * 3.0).powi(3))
                .collect()
        };
        let mut bases = vec![
            Nf4Weight::quantize(&values(7 * 19, 1), [7, 19], false).unwrap(),
            Nf4Weight::quantize(&values(130 * 129, 2), [130, 129], true).unwrap(),
            Nf4Weight::quantize(&values(3, 3), [1, 3], true).unwrap(),
        ];
        // Scales whose bits are NaN payloads and subnormals: only copies
        // may touch the words.
        if let Scales::Fp32(a) = &mut bases[0].scales {
            a[0] = f32::from_bits(0x7fa0_0001);
            a[1] = f32::from_bits(0x0000_0003);
        }
        let (infos, words) = encode_nf4(&bases);
        for shards in [1, 2, 3, 5] {
            let per = words.len().div_ceil(shards);
            let mut cut = words.clone();
            cut.resize(per * shards, 0.0);
            let gathered: Vec<f32> = cut.chunks(per).flat_map(|c| c.to_vec()).collect();
            let back = decode_nf4(&infos, &gathered[..words.len()]).unwrap();
            assert_eq!(back.len(), bases.len());
            for (a, b) in back.iter().zip(&bases) {
                assert_eq!(a.packed, b.packed);
                assert_eq!(a.shape, b.shape);
                match (&a.scales, &b.scales) {
                    (Scales::Fp32(x), Scales::Fp32(y)) => assert_eq!(
                        x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    ),
                    (x, y) => assert_eq!(x, y),
                }
            }
        }
        // A stream cut short is named, not read past its end.
        let e = decode_nf4(&infos, &words[..words.len() / 2]).unwrap_err();
        assert!(e.to_string().contains("NF4 base"), "{e}");
    }

    #[test]
    fn a_qlora_base_is_never_offloaded() {
        let mut plan = crate::testing::tiny_plan();
        plan.adapter = Some(AdapterSpec {
            kind: AdapterKind::Qlora,
            rank: 4,
            alpha: 8.0,
            targets: vec![Proj::Q],
            dropout: 0.0,
            base: Dtype::Nf4,
        });
        plan.resolved.data = 2;
        plan.resolved.zero = 3;
        // ZeRO-3 shards the base: executed.
        assert!(refuse_quantized_base(&plan).is_ok());
        plan.resolved.zero = 2;
        assert!(refuse_quantized_base(&plan).is_ok());
        plan.resolved.offload = vec![Offload {
            what: OffloadWhat::Params,
            to: OffloadTo::Cpu,
        }];
        let e = refuse_quantized_base(&plan).unwrap_err().to_string();
        assert!(e.contains("parameters offloaded"), "{e}");
        // LoRA's dense base is offloaded like any weight.
        plan.adapter.as_mut().unwrap().kind = AdapterKind::Lora;
        plan.adapter.as_mut().unwrap().base = Dtype::Fp32;
        assert!(refuse_quantized_base(&plan).is_ok());
    }
}
