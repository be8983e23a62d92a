//! Orders work on a CUDA stream of kiln's own against this thread's cubecl stream,
//! on the GPU, without the host waiting for either: the fallback for when cubecl's
//! stream itself cannot be learnt (`cubecl_stream`), which orders kiln's work by
//! construction and needs none of this.
//!
//! cubecl 0.10 keeps its streams private, so no event can be recorded on one. What a
//! cubecl stream can do is run kernels on buffers whose device addresses kiln knows.
//! Two flags in one cubecl buffer carry the hand-over, each set and awaited by
//! one-thread kernels:
//!
//! 1. cubecl's stream stores a fresh token in flag 0, after the kernels that produce
//!    the inputs;
//! 2. kiln's stream spins until flag 0 holds the token, runs its work (cuDNN), then
//!    stores the token in flag 1;
//! 3. cubecl's stream spins until flag 1 holds the token, so no later cubecl kernel
//!    reads the results, or reuses a buffer kiln's stream still reads or writes,
//!    before that work is done.
//!
//! No cycle: kiln's stream only waits for a store that cubecl's stream has queued
//! ahead of its own spinning kernel, and kiln's whole part is queued before that
//! kernel is. One residual risk: cubecl's spinning kernel holds one block's resources
//! on one SM while cuDNN works, so a cuDNN kernel that needs every SM's full capacity
//! at once (a cooperative launch) never finishes. cuDNN's persistent batch norm, which
//! channels-last uses, is one (its first ResNet step never ended): those calls skip
//! step 3 and the host waits for kiln's stream (`kiln_stream::After::Host`). No
//! convolution hung in the shapes measured (ResNet-18 and -50 and the correctness
//! test); should one, the step watchdog ends the process and the supervisor restarts
//! it from its checkpoint.
//!
//! CUDA's stream memory operations would spare kiln's two kernels, but
//! `cuStreamWaitValue32` on a cubecl buffer returned CUDA_ERROR_INVALID_VALUE on the
//! H200s here. Kiln's two kernels are compiled with NVRTC when a thread first needs
//! them, as cubecl compiles its own.

use std::ffi::{CString, c_void};
use std::mem::ManuallyDrop;

use burn::cubecl::cuda::CudaRuntime;
use burn::cubecl::server::Handle;
use cubecl::prelude::*;
use cudarc::driver::{result as drv, sys as dsys};

type Client = ComputeClient<CudaRuntime>;
/// The launch function `#[cube(launch)]` generates for `store_flag` and `await_flag`.
type CubeLaunch = fn(&Client, CubeCount, CubeDim, ArrayArg<CudaRuntime>, u32);

#[cube(launch)]
fn store_flag(flags: &mut Array<Atomic<u32>>, token: u32) {
    flags[0].store(token);
}

#[cube(launch)]
fn await_flag(flags: &mut Array<Atomic<u32>>, token: u32) {
    loop {
        if flags[1].load() == token {
            break;
        }
    }
}

/// Kiln's side, for its own stream: `volatile`, so every turn reads memory again.
const KERNELS: &str = r#"
extern "C" __global__ void wait_flag(volatile unsigned int *flags, unsigned int token) {
    while (flags[0] != token) {}
}
extern "C" __global__ void store_flag(volatile unsigned int *flags, unsigned int token) {
    __threadfence();
    flags[1] = token;
}
"#;

/// The two flags of one thread and device, the last token handed out, and kiln's
/// two kernels (their module is kept until the process ends, as cuDNN's handle is).
pub struct Handover {
    /// Held so that cubecl keeps the flags' memory where `ptr` points, and never
    /// given back: a thread's last spinning kernel may still read the flags after the
    /// thread has ended, and freed memory could be handed to another stream.
    flags: ManuallyDrop<Handle>,
    ptr: u64,
    token: u32,
    wait: dsys::CUfunction,
    store: dsys::CUfunction,
}

fn cuda(what: &str, e: drv::DriverError) -> String {
    format!("{what}: {:?}", e.0)
}

impl Handover {
    /// Needs the device's context current on this thread.
    pub fn new(client: &Client) -> Result<Self, String> {
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| format!("NVRTC: {e:?}"))?;
        let image = CString::new(ptx.to_src()).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated PTX image; the module is never unloaded, so the
        // functions stay valid.
        let (wait, store) = unsafe {
            let module = drv::module::load_data(image.as_ptr() as *const c_void)
                .map_err(|e| cuda("cuModuleLoadData", e))?;
            let get = |name: &str| {
                drv::module::get_function(module, CString::new(name).expect("no NUL"))
                    .map_err(|e| cuda("cuModuleGetFunction", e))
            };
            (get("wait_flag")?, get("store_flag")?)
        };
        let flags = client.create_from_slice(&[0u8; 8]);
        let ptr = client
            .get_resource(flags.clone())
            .map_err(|e| format!("{e:?}"))?
            .resource()
            .ptr;
        Ok(Handover {
            flags: ManuallyDrop::new(flags),
            ptr,
            token: 0,
            wait,
            store,
        })
    }

    /// One thread of `f(flags, token)` on `stream`.
    fn launch(
        &self,
        f: dsys::CUfunction,
        stream: dsys::CUstream,
        token: u32,
    ) -> Result<(), String> {
        let (mut ptr, mut token) = (self.ptr, token);
        let mut params = [
            &mut ptr as *mut u64 as *mut c_void,
            &mut token as *mut u32 as *mut c_void,
        ];
        // SAFETY: both kernels take (unsigned int *, unsigned int); `ptr` is the live
        // flags buffer on this stream's device.
        unsafe { drv::launch_kernel(f, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }
            .map_err(|e| cuda("cuLaunchKernel", e))
    }

    /// One thread of cubecl kernel `launch(flags, token)` on this thread's cubecl stream.
    fn on_cubecl(&self, client: &Client, launch: CubeLaunch, token: u32) {
        // SAFETY: the buffer holds two u32 values.
        let flags = unsafe { ArrayArg::from_raw_parts(Handle::clone(&self.flags), 2) };
        launch(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            flags,
            token,
        );
    }

    /// Step 1 and the wait of step 2: `stream` runs nothing queued after this until
    /// everything queued on this thread's cubecl stream before it has run.
    ///
    /// Must run on cubecl's device thread (`ComputeClient::exclusive`). Elsewhere
    /// cubecl only queues the store for that thread, and a kernel spinning on the GPU
    /// for a store still in that queue could wait forever if the device thread
    /// meanwhile waited for the whole GPU (freeing memory does). On the device
    /// thread the store reaches CUDA's stream before this returns.
    pub fn wait_for_cubecl(
        &mut self,
        client: &Client,
        stream: dsys::CUstream,
    ) -> Result<u32, String> {
        // Never 0, the flags' first value.
        self.token = self.token.wrapping_add(1).max(1);
        let token = self.token;
        self.on_cubecl(client, store_flag::launch::<CudaRuntime>, token);
        self.launch(self.wait, stream, token)?;
        Ok(token)
    }

    /// Step 2's write and step 3: nothing queued on this thread's cubecl stream after
    /// this runs before everything queued on `stream` before it has. Call it whatever
    /// the work on `stream` reported, once `wait_for_cubecl` succeeded: it is what
    /// lets cubecl's stream go on.
    pub fn cubecl_waits_for(
        &self,
        client: &Client,
        stream: dsys::CUstream,
        token: u32,
    ) -> Result<(), String> {
        // Without this queued, the spinning kernel below would never end: the caller
        // waits on the host instead.
        self.launch(self.store, stream, token)?;
        self.on_cubecl(client, await_flag::launch::<CudaRuntime>, token);
        Ok(())
    }
}
