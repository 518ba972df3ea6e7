//! A contiguous tensor on a CubeCL device, uploaded from and read back as
//! f32 on the host, whatever type it holds: what the kernel tests
//! (`tests_kernels.rs`) and the kernel benchmark (`benches/flash.rs`) hand
//! the launches in `launch.rs`.

use cubecl::prelude::*;

/// An element type a [`DeviceTensor`] holds: f32, f16 or bf16, converted
/// from and to f32 on the host.
pub trait Elem: CubeElement + Float {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for burn::tensor::f16 {
    fn from_f32(x: f32) -> Self {
        Self::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

impl Elem for burn::tensor::bf16 {
    fn from_f32(x: f32) -> Self {
        Self::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

/// A contiguous tensor on the device.
pub struct DeviceTensor<R: Runtime> {
    handle: cubecl::server::Handle,
    runtime: std::marker::PhantomData<R>,
    shape: Vec<usize>,
}

impl<R: Runtime> DeviceTensor<R> {
    pub fn new(client: &ComputeClient<R>, data: &[f32], shape: &[usize]) -> Self {
        Self::new_as::<f32>(client, data, shape)
    }

    /// `data` stored as `E`.
    pub fn new_as<E: Elem>(client: &ComputeClient<R>, data: &[f32], shape: &[usize]) -> Self {
        assert_eq!(data.len(), shape.iter().product::<usize>());
        let data: Vec<E> = data.iter().map(|&x| E::from_f32(x)).collect();
        DeviceTensor {
            handle: client.create_from_slice(E::as_bytes(&data)),
            shape: shape.to_vec(),
            runtime: std::marker::PhantomData,
        }
    }

    pub fn zeros(client: &ComputeClient<R>, shape: &[usize]) -> Self {
        Self::zeros_as::<f32>(client, shape)
    }

    pub fn zeros_as<E: Elem>(client: &ComputeClient<R>, shape: &[usize]) -> Self {
        Self::new_as::<E>(client, &vec![0.0; shape.iter().product()], shape)
    }

    pub fn arg(&self) -> TensorArg<R> {
        let mut strides = vec![1; self.shape.len()];
        for i in (0..self.shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.shape[i + 1];
        }
        // SAFETY: the handle holds a contiguous tensor of this shape.
        unsafe {
            TensorArg::from_raw_parts(
                self.handle.clone(),
                strides.as_slice().into(),
                self.shape.as_slice().into(),
            )
        }
    }

    pub fn read(&self, client: &ComputeClient<R>) -> Vec<f32> {
        self.read_as::<f32>(client)
    }

    pub fn read_as<E: Elem>(&self, client: &ComputeClient<R>) -> Vec<f32> {
        let bytes = client.read_one_unchecked(self.handle.clone());
        E::from_bytes(&bytes).iter().map(|&x| x.to_f32()).collect()
    }
}
