//! The CUDA side of the KV transfer agent, through `cudarc` with the driver loaded at run time.
//!
//! KV caches live in device memory; the TCP backend moves host memory. This module owns the
//! bridge: [`DeviceRegion`] (a device buffer an agent can register, served by staging the
//! requested range device → host) and [`Agent::read_into_device`] (read into a host staging
//! buffer, then copy host → device). Real NIXL would use GPUDirect RDMA; staging is what a TCP
//! hop needs anyway.
//!
//! Detection is at run time: [`detect`] checks for `libcuda` *before* touching any cudarc
//! context (cudarc panics when the library is missing), then asks for a device. Without a
//! driver nothing here panics: [`CudaDevice::open`] returns
//! [`TransferError::BackendUnavailable`] and callers log it loudly and fall back to TCP.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use parking_lot::Mutex;

use super::agent::{Agent, Descriptor, ReadOutcome};
use super::TransferError;

/// What run-time detection found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaStatus {
    Available { devices: usize },
    Unavailable { reason: String },
}

/// Looks for a CUDA driver and devices without panicking.
pub fn detect() -> CudaStatus {
    // SAFETY: only tries to dlopen libcuda / nvcuda; no symbol is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return CudaStatus::Unavailable {
            reason: "no CUDA driver (libcuda.so) found".into(),
        };
    }
    // The library exists, so cudarc's lazy loader will not panic; still guard against a
    // driver that aborts initialisation in unexpected ways.
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => CudaStatus::Available {
            devices: n as usize,
        },
        Ok(Ok(_)) => CudaStatus::Unavailable {
            reason: "CUDA driver present but no devices".into(),
        },
        Ok(Err(e)) => CudaStatus::Unavailable {
            reason: format!("CUDA driver error: {e}"),
        },
        Err(_) => CudaStatus::Unavailable {
            reason: "CUDA driver initialisation panicked".into(),
        },
    }
}

/// An opened CUDA device with a stream for staging copies.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    ordinal: usize,
    stream: Arc<CudaStream>,
}

fn driver_err(e: impl std::fmt::Display) -> TransferError {
    TransferError::Cuda(e.to_string())
}

impl CudaDevice {
    /// Opens device `ordinal`, or says why it cannot.
    pub fn open(ordinal: usize) -> Result<CudaDevice, TransferError> {
        match detect() {
            CudaStatus::Available { devices } if ordinal < devices => {}
            CudaStatus::Available { devices } => {
                return Err(TransferError::BackendUnavailable(format!(
                    "CUDA device {ordinal} requested, {devices} present"
                )))
            }
            CudaStatus::Unavailable { reason } => {
                return Err(TransferError::BackendUnavailable(reason))
            }
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
        Ok(CudaDevice {
            ordinal,
            stream: ctx.default_stream(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// A zeroed device buffer of `len` bytes.
    pub fn alloc(&self, len: usize) -> Result<DeviceRegion, TransferError> {
        let buf = self.stream.alloc_zeros::<u8>(len).map_err(driver_err)?;
        Ok(DeviceRegion {
            stream: self.stream.clone(),
            buf: Mutex::new(buf),
            len,
        })
    }

    /// Copies host bytes into a new device buffer.
    pub fn upload(&self, data: &[u8]) -> Result<DeviceRegion, TransferError> {
        let buf = self.stream.clone_htod(data).map_err(driver_err)?;
        self.stream.synchronize().map_err(driver_err)?;
        Ok(DeviceRegion {
            stream: self.stream.clone(),
            buf: Mutex::new(buf),
            len: data.len(),
        })
    }
}

/// A device buffer (KV blocks in GPU memory).
#[derive(Debug)]
pub struct DeviceRegion {
    stream: Arc<CudaStream>,
    buf: Mutex<CudaSlice<u8>>,
    len: usize,
}

impl DeviceRegion {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device → host staging copy of `[offset, offset+len)`.
    pub fn read_range(&self, offset: usize, len: usize) -> Result<Vec<u8>, TransferError> {
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= self.len)
            .ok_or_else(|| {
                TransferError::BadDescriptor(format!(
                    "range {offset}+{len} outside device region of {} bytes",
                    self.len
                ))
            })?;
        let buf = self.buf.lock();
        let view = buf.slice(offset..end);
        let host = self.stream.clone_dtoh(&view).map_err(driver_err)?;
        self.stream.synchronize().map_err(driver_err)?;
        Ok(host)
    }

    /// Host staging → device copy at `offset`.
    pub fn write_range(&self, offset: usize, data: &[u8]) -> Result<(), TransferError> {
        let end = offset
            .checked_add(data.len())
            .filter(|e| *e <= self.len)
            .ok_or_else(|| {
                TransferError::BadDescriptor(format!(
                    "write {offset}+{} outside device region of {} bytes",
                    data.len(),
                    self.len
                ))
            })?;
        let mut buf = self.buf.lock();
        let mut view = buf.slice_mut(offset..end);
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(driver_err)?;
        self.stream.synchronize().map_err(driver_err)
    }

    pub fn to_host(&self) -> Result<Vec<u8>, TransferError> {
        self.read_range(0, self.len)
    }
}

impl Agent {
    /// Reads remote descriptors into device memory at `offset`: the bytes land in a host
    /// staging buffer over TCP, then are copied to the device. The outcome's `data` is the
    /// staging buffer.
    pub async fn read_into_device(
        &self,
        remote: &str,
        descriptors: &[Descriptor],
        dst: &DeviceRegion,
        offset: usize,
    ) -> Result<ReadOutcome, TransferError> {
        let total: u64 = descriptors.iter().map(|d| d.len).sum();
        let staging = vec![0u8; total as usize];
        let outcome = self.read(remote, descriptors, staging)?.wait().await?;
        dst.write_range(offset, &outcome.data)?;
        Ok(outcome)
    }
}
