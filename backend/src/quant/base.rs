//! QLoRA's frozen base weight as a field of a Burn module: the packed NF4
//! weight ([`Nf4Tensor`]) and nothing else, so no fp32 copy of the base
//! exists between uses.
//!
//! Burn's module machinery sees it as a constant with a record:
//! - `visit` and `map` skip it: it is no float parameter, so no visitor of
//!   the trainer (parameter counts, checksums, gradients, the optimizer,
//!   ZeRO's flat vectors, the 16-bit casts) can touch, count or cast it;
//!   [`Nf4Base::params`] gives its element count to whoever reports it;
//! - its record is the host form ([`Nf4Weight`]: codes, scales, shape), so
//!   `--save` writes the quantized base and `--resume` restores it bit for bit.
//!   A record that does not fit (another shape, inconsistent lengths) is kept
//!   out and named by [`Nf4Base::load_error`], which the trainer checks.
//!
//! A layer holds it in an [`Nf4Slot`] (present under QLoRA), not an
//! `Option`: Burn's `Option` loads a record only into a module with float
//! parameters, so an `Option<Nf4Base>` would silently keep its old base.

use super::nf4::{Nf4Tensor, Nf4Weight, Scales};
use super::QuantError;
use burn::module::{
    AutodiffModule, Content, Devices, HasAutodiffModule, Module, ModuleDisplay,
    ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::backend::{AutodiffBackend, Backend};

/// A frozen NF4 weight `[d_in, d_out]` on a device.
#[derive(Clone, Debug)]
pub struct Nf4Base<B: Backend> {
    pub w: Nf4Tensor<B>,
    /// Why the last `load_record` (or load from a checkpoint) was refused.
    load_error: Option<String>,
}

/// The record: packed codes, then the fp32 scales (the absmax, or the
/// second-level scales of double quantization), the scale codes (empty
/// without double quantization), the offset, and `[rows, cols]`.
pub type Nf4Record = (Vec<u8>, Vec<f32>, Vec<u8>, f32, [usize; 2]);

impl<B: Backend> Nf4Base<B> {
    pub fn new(w: Nf4Tensor<B>) -> Self {
        Nf4Base {
            w,
            load_error: None,
        }
    }

    /// Quantizes the row-major fp32 `values` of `shape` onto `device`.
    pub fn quantize(
        values: &[f32],
        shape: [usize; 2],
        double: bool,
        device: &B::Device,
    ) -> Result<Self, QuantError> {
        let w = Nf4Weight::quantize(values, shape, double)?;
        Ok(Self::new(w.to_device(device)?))
    }

    /// Elements of the (unquantized) weight.
    pub fn params(&self) -> usize {
        self.w.shape[0] * self.w.shape[1]
    }

    /// Why a record or a load into this weight was refused, if one was.
    pub fn load_error(&self) -> Option<&str> {
        self.load_error.as_deref()
    }

    /// Keep this weight and remember why the replacement was refused.
    pub fn refuse(mut self, why: String) -> Self {
        self.load_error = Some(why);
        self
    }

    fn tensor_of(&self, r: Nf4Record) -> Result<Nf4Tensor<B>, String> {
        let (packed, floats, codes, offset, shape) = r;
        if shape != self.w.shape {
            return Err(format!(
                "an NF4 base weight of shape {:?} in the checkpoint, {:?} in the model",
                shape, self.w.shape
            ));
        }
        let scales = if codes.is_empty() {
            Scales::Fp32(floats)
        } else {
            Scales::Double {
                codes,
                absmax2: floats,
                offset,
            }
        };
        let host = Nf4Weight {
            packed,
            scales,
            shape,
        };
        host.to_device(&self.w.packed.device())
            .map_err(|e| format!("an NF4 base weight in the checkpoint: {e}"))
    }
}

impl<B: Backend> Module<B> for Nf4Base<B> {
    type Record = Nf4Record;

    fn collect_devices(&self, mut devices: Devices<B>) -> Devices<B> {
        let d = self.w.packed.device();
        if !devices.contains(&d) {
            devices.push(d);
        }
        devices
    }

    fn fork(self, device: &B::Device) -> Self {
        self.to_device(device)
    }

    fn to_device(self, device: &B::Device) -> Self {
        use super::nf4::DeviceScales;
        let w = self.w;
        let scales = match w.scales {
            DeviceScales::Fp32(a) => DeviceScales::Fp32(a.to_device(device)),
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => DeviceScales::Double {
                codes: codes.to_device(device),
                absmax2: absmax2.to_device(device),
                offset,
            },
        };
        Nf4Base {
            w: Nf4Tensor {
                packed: w.packed.to_device(device),
                scales,
                shape: w.shape,
            },
            load_error: self.load_error,
        }
    }

    /// The weight's elements (frozen parameters, though no visitor sees them).
    fn num_params(&self) -> usize {
        self.params()
    }

    fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
        self
    }

    fn load_record(self, record: Self::Record) -> Self {
        match self.tensor_of(record) {
            Ok(w) => Nf4Base::new(w),
            Err(why) => self.refuse(why),
        }
    }

    fn into_record(self) -> Self::Record {
        // A device read that fails leaves short vectors, which `load_record`
        // refuses by name rather than loading a wrong weight.
        let (packed, floats, codes, offset) = match self.w.to_host() {
            Ok(h) => match h.scales {
                Scales::Fp32(a) => (h.packed, a, Vec::new(), 0.0),
                Scales::Double {
                    codes,
                    absmax2,
                    offset,
                } => (h.packed, absmax2, codes, offset),
            },
            Err(_) => (Vec::new(), Vec::new(), Vec::new(), 0.0),
        };
        (packed, floats, codes, offset, self.w.shape)
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for Nf4Base<B> {
    type InnerModule = Nf4Base<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        Nf4Base {
            w: self.w.inner(),
            load_error: self.load_error.clone(),
        }
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        Nf4Base {
            w: Nf4Tensor::from_inner(module.w),
            load_error: module.load_error,
        }
    }
}

impl<B: AutodiffBackend> HasAutodiffModule<B> for Nf4Base<B::InnerBackend> {
    type TrainModule = Nf4Base<B>;
}

impl<B: Backend> ModuleDisplayDefault for Nf4Base<B> {
    fn content(&self, content: Content) -> Option<Content> {
        let s = format!("Nf4Base {{shape: {:?}}}", self.w.shape);
        content.add_single(&s).optional()
    }
}

impl<B: Backend> ModuleDisplay for Nf4Base<B> {}

/// An optional NF4 base as a module field: `Option<Nf4Base>` would not do,
/// as Burn loads an `Option`'s record only into a module with float
/// parameters. A base whose record is absent (a checkpoint written without
/// QLoRA) is kept and refused by name.
#[derive(Clone, Debug)]
pub struct Nf4Slot<B: Backend>(pub Option<Nf4Base<B>>);

impl<B: Backend> Module<B> for Nf4Slot<B> {
    type Record = Option<Nf4Record>;

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        match &self.0 {
            Some(b) => b.collect_devices(devices),
            None => devices,
        }
    }

    fn fork(self, device: &B::Device) -> Self {
        Nf4Slot(self.0.map(|b| b.fork(device)))
    }

    fn to_device(self, device: &B::Device) -> Self {
        Nf4Slot(self.0.map(|b| b.to_device(device)))
    }

    fn num_params(&self) -> usize {
        self.0.as_ref().map_or(0, |b| b.params())
    }

    fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
        self
    }

    fn load_record(self, record: Self::Record) -> Self {
        Nf4Slot(match (self.0, record) {
            (Some(b), Some(r)) => Some(b.load_record(r)),
            (Some(b), None) => Some(b.refuse(
                "the checkpoint holds no NF4 base for a QLoRA projection: it was written for the \
                 other adapter kind (lora vs qlora)"
                    .into(),
            )),
            // A dense layer: the dense weight's own record says whether it fits.
            (None, _) => None,
        })
    }

    fn into_record(self) -> Self::Record {
        self.0.map(Module::into_record)
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for Nf4Slot<B> {
    type InnerModule = Nf4Slot<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        Nf4Slot(self.0.as_ref().map(|b| b.valid()))
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        Nf4Slot(module.0.map(Nf4Base::from_inner))
    }
}

impl<B: AutodiffBackend> HasAutodiffModule<B> for Nf4Slot<B::InnerBackend> {
    type TrainModule = Nf4Slot<B>;
}

impl<B: Backend> ModuleDisplayDefault for Nf4Slot<B> {
    fn content(&self, content: Content) -> Option<Content> {
        match &self.0 {
            Some(b) => b.content(content),
            None => content.add_single(&"none".to_string()).optional(),
        }
    }
}

impl<B: Backend> ModuleDisplay for Nf4Slot<B> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::tests::det_weights;
    use burn::module::Module;

    type Cpu = burn::backend::NdArray<f32>;

    /// The record holds the quantized weight exactly; a record of another
    /// shape or with inconsistent lengths is refused by name, the weight
    /// kept; the device holds codes and scales only (bitsandbytes' bytes).
    #[test]
    fn record_round_trips_and_bad_records_are_refused() {
        let device = Default::default();
        for double in [false, true] {
            let (rows, cols) = (96, 200);
            let w = det_weights(rows * cols, 0.003);
            let q = Nf4Base::<Cpu>::quantize(&w, [rows, cols], double, &device).unwrap();
            let host = q.w.to_host().unwrap();
            assert_eq!(host, Nf4Weight::quantize(&w, [rows, cols], double).unwrap());
            assert_eq!(q.w.bytes(), host.bytes(), "no padding on the device");
            let fresh =
                Nf4Base::<Cpu>::quantize(&vec![0.5; rows * cols], [rows, cols], double, &device)
                    .unwrap();
            let loaded = fresh.clone().load_record(q.clone().into_record());
            assert!(loaded.load_error().is_none());
            assert_eq!(loaded.w.to_host().unwrap(), host);
            assert_eq!(
                loaded.w.dequantize().into_data().to_vec::<f32>().unwrap(),
                host.dequantize().unwrap()
            );

            let mut other = q.clone().into_record();
            other.4 = [cols, rows];
            let kept = fresh.clone().load_record(other);
            assert!(kept.load_error().unwrap().contains("shape [200, 96]"));
            assert_eq!(kept.w.to_host().unwrap(), fresh.w.to_host().unwrap());
            let mut short = q.clone().into_record();
            short.0.pop();
            let e = fresh.clone().load_record(short);
            assert!(
                e.load_error().unwrap().contains("packed codes"),
                "{:?}",
                e.load_error()
            );
        }
    }
}
