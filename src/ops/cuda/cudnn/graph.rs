//! Convolutions through cuDNN's graph (backend) API: each shape's execution plan is
//! built and finalized once, and a call only executes it.
//!
//! cuDNN 9 carries out a legacy call (`cudnnConvolutionForward` and the two backward
//! ones) by building and finalizing an operation graph and engine configurations every
//! time: its API log shows `cudnnBackendFinalizeGraph` and two or three
//! `cudnnBackendFinalizeEngineCfg` inside each call. On an H200 that was 90-240 µs of
//! host time per convolution, spent on cubecl's device thread, which held ResNet-50's
//! step to three times its GPU time (BENCHMARKS.md, "Throughput"). PyTorch keeps
//! finalized plans the same way (through cuDNN's frontend library).

use std::ffi::c_void;
use std::ptr::null_mut;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Type,
    cudnnBackendDescriptorType_t as Kind,
};

use super::{ConvKey, workspace_limit};
use crate::ops::{ConvPass, Layout};

/// The graph API's entry points, checked before the first plan (a cuDNN without them
/// keeps the legacy calls).
pub(super) const SYMBOLS: [&str; 6] = [
    "cudnnBackendCreateDescriptor",
    "cudnnBackendDestroyDescriptor",
    "cudnnBackendSetAttribute",
    "cudnnBackendGetAttribute",
    "cudnnBackendFinalize",
    "cudnnBackendExecute",
];

/// The tensors' ids in a plan: the input, the filter and the output of the forward
/// convolution, whichever of them a part writes.
const X: i64 = 1;
const W: i64 = 2;
const Y: i64 = 3;

/// cuDNN's tensors are described with this pointer alignment, the one its legacy
/// calls assume too (its API log); cubecl-cuda 0.10 aligns its buffers to 512 bytes.
const ALIGNMENT: i64 = 16;

/// One backend descriptor, destroyed on drop.
struct Desc(sys::cudnnBackendDescriptor_t);

/// `s` as a result; `what` names the step in the error (made only on failure: the
/// steps of a call run for every convolution).
fn status(what: impl std::fmt::Display, s: sys::cudnnStatus_t) -> Result<(), String> {
    match s {
        sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS => Ok(()),
        other => Err(format!("{what}: {other:?}")),
    }
}

impl Desc {
    fn new(kind: Kind) -> Result<Self, String> {
        let mut d = null_mut();
        // SAFETY: cuDNN writes a new descriptor into `d`.
        status("cudnnBackendCreateDescriptor", unsafe {
            sys::cudnnBackendCreateDescriptor(kind, &mut d)
        })?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to `values`, which must be of the C type `ty` names.
    fn set<V>(&self, name: Attr, ty: Type, values: &[V]) -> Result<(), String> {
        // SAFETY: a live descriptor; cuDNN reads `values.len()` elements of `ty`, which
        // the callers pass as the matching Rust type, and copies them.
        status(format_args!("setting {name:?}"), unsafe {
            sys::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        })
    }

    fn set_desc(&self, name: Attr, value: &Desc) -> Result<(), String> {
        self.set(name, Type::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[value.0])
    }

    fn finalize(self, what: &str) -> Result<Self, String> {
        // SAFETY: a live descriptor.
        status(format_args!("finalizing {what}"), unsafe {
            sys::cudnnBackendFinalize(self.0)
        })?;
        Ok(self)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `Desc::new` and destroyed only here.
        unsafe {
            sys::cudnnBackendDestroyDescriptor(self.0);
        }
    }
}

/// One convolution shape's finalized execution plan.
pub(super) struct GraphPlan {
    plan: Desc,
    /// What the plan was made from, kept as long as it (cuDNN's documentation does
    /// not promise that a finalized plan holds copies).
    _parts: Vec<Desc>,
    pub(super) workspace: usize,
}

/// The strides of a contiguous tensor in `layout` with `dims` in NCHW (KCRS) order,
/// in that order too: its own axes' strides, reordered by the layout's axis table.
fn strides(dims: [i32; 4], layout: Layout) -> [i64; 4] {
    let laid_out = layout.laid_out_dims(dims.map(|d| d as usize));
    let mut strides = [1; 4];
    for axis in (0..3).rev() {
        strides[axis] = strides[axis + 1] * laid_out[axis + 1];
    }
    layout.nchw_dims(strides).map(|s| s as i64)
}

/// A 4-d tensor of `data` with `dims` in NCHW (KCRS) order, laid out as `layout`.
fn tensor(
    id: i64,
    data: sys::cudnnDataType_t,
    dims: [i32; 4],
    layout: Layout,
) -> Result<Desc, String> {
    let strides = strides(dims, layout);
    let [n, c, h, w] = dims.map(i64::from);
    let t = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.set(
        Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
        Type::CUDNN_TYPE_DATA_TYPE,
        &[data],
    )?;
    t.set(
        Attr::CUDNN_ATTR_TENSOR_DIMENSIONS,
        Type::CUDNN_TYPE_INT64,
        &[n, c, h, w],
    )?;
    t.set(
        Attr::CUDNN_ATTR_TENSOR_STRIDES,
        Type::CUDNN_TYPE_INT64,
        &strides,
    )?;
    t.set(
        Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID,
        Type::CUDNN_TYPE_INT64,
        &[id],
    )?;
    t.set(
        Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
        Type::CUDNN_TYPE_INT64,
        &[ALIGNMENT],
    )?;
    t.finalize("a tensor")
}

impl GraphPlan {
    /// The first plan cuDNN's heuristics propose for `key` that finalizes and whose
    /// workspace fits. Grouped convolutions are left to the legacy calls.
    pub(super) fn new(handle: sys::cudnnHandle_t, key: &ConvKey) -> Result<Self, String> {
        let o = &key.options;
        if o.groups != 1 {
            return Err("grouped convolutions take cuDNN's legacy calls".into());
        }
        let [xd, wd, yd] = key.dims;
        let x = tensor(X, key.data, xd, key.layout)?;
        let w = tensor(W, key.data, wd, key.layout)?;
        let y = tensor(Y, key.data, yd, key.layout)?;
        let pair = |v: [usize; 2]| [v[0] as i64, v[1] as i64];
        let conv = Desc::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        // Half and bfloat16 data accumulate in f32, as PyTorch's autocast does.
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
            Type::CUDNN_TYPE_DATA_TYPE,
            &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            Type::CUDNN_TYPE_CONVOLUTION_MODE,
            &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
        )?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS,
            Type::CUDNN_TYPE_INT64,
            &[2i64],
        )?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS,
            Type::CUDNN_TYPE_INT64,
            &pair(o.dilation),
        )?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
            Type::CUDNN_TYPE_INT64,
            &pair(o.stride),
        )?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS,
            Type::CUDNN_TYPE_INT64,
            &pair(o.padding),
        )?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS,
            Type::CUDNN_TYPE_INT64,
            &pair(o.padding),
        )?;
        let conv = conv.finalize("the convolution")?;

        // The operation's attributes by part: its kind, then alpha, beta, the
        // convolution and its three tensors.
        use Attr::*;
        let (kind, names) = match key.part {
            ConvPass::Forward => (
                Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
                [
                    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                ],
            ),
            ConvPass::GradX => (
                Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
                [
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                ],
            ),
            ConvPass::GradWeight => (
                Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
                [
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                    CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                ],
            ),
        };
        let [alpha, beta, conv_desc, x_name, w_name, y_name] = names;
        let op = Desc::new(kind)?;
        // The result replaces the output, or is added to it.
        let beta_value = if key.accumulate { 1.0f32 } else { 0.0 };
        op.set(alpha, Type::CUDNN_TYPE_FLOAT, &[1.0f32])?;
        op.set(beta, Type::CUDNN_TYPE_FLOAT, &[beta_value])?;
        op.set_desc(conv_desc, &conv)?;
        op.set_desc(x_name, &x)?;
        op.set_desc(w_name, &w)?;
        op.set_desc(y_name, &y)?;
        let op = op.finalize("the operation")?;

        let graph = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_desc(CUDNN_ATTR_OPERATIONGRAPH_OPS, &op)?;
        graph.set(
            CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
            Type::CUDNN_TYPE_HANDLE,
            &[handle],
        )?;
        let graph = graph.finalize("the operation graph")?;

        let heuristics = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heuristics.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?;
        heuristics.set(
            CUDNN_ATTR_ENGINEHEUR_MODE,
            Type::CUDNN_TYPE_HEUR_MODE,
            &[sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
        )?;
        let heuristics = heuristics.finalize("the heuristics")?;
        let configs = proposals(&heuristics)?;

        let mut last = String::from("cuDNN's heuristics proposed no engine");
        for config in configs {
            let plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(
                CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                Type::CUDNN_TYPE_HANDLE,
                &[handle],
            )?;
            plan.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &config)?;
            let plan = match plan.finalize("an execution plan") {
                Ok(plan) => plan,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let mut workspace = 0i64;
            let mut count = 0i64;
            // SAFETY: a finalized plan; cuDNN writes one i64.
            status("the plan's workspace", unsafe {
                sys::cudnnBackendGetAttribute(
                    plan.0,
                    CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                    Type::CUDNN_TYPE_INT64,
                    1,
                    &mut count,
                    &mut workspace as *mut i64 as *mut c_void,
                )
            })?;
            if workspace as usize > workspace_limit() {
                last = format!(
                    "the plans that finalize need over {} MiB of workspace (kernels.conv_workspace_mib)",
                    workspace_limit() >> 20
                );
                continue;
            }
            return Ok(GraphPlan {
                plan,
                _parts: vec![x, w, y, conv, op, graph, heuristics, config],
                workspace: workspace as usize,
            });
        }
        Err(format!("no execution plan for {key:?}: {last}"))
    }

    /// Queues the convolution on `handle`'s stream: `x`, `w` and `y` are the forward
    /// convolution's input, filter and output (the part's result is one of them).
    ///
    /// # Safety
    /// The pointers are live device buffers of the sizes and layouts the plan's key
    /// describes, and `workspace` holds at least [`GraphPlan::workspace`] bytes (or
    /// is null when that is 0), until the work on the stream is done.
    pub(super) unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        [x, w, y]: [*mut c_void; 3],
        workspace: *mut c_void,
    ) -> Result<(), String> {
        let pack = Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            Type::CUDNN_TYPE_INT64,
            &[X, W, Y],
        )?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            Type::CUDNN_TYPE_VOID_PTR,
            &[x, w, y],
        )?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            Type::CUDNN_TYPE_VOID_PTR,
            &[workspace],
        )?;
        let pack = pack.finalize("the variant pack")?;
        // SAFETY: a finalized plan and variant pack; the caller vouches for the buffers.
        status("cudnnBackendExecute", unsafe {
            sys::cudnnBackendExecute(handle, self.plan.0, pack.0)
        })
    }
}

/// The engine configurations `heuristics` proposes, best first.
fn proposals(heuristics: &Desc) -> Result<Vec<Desc>, String> {
    let mut count = 0i64;
    // SAFETY: a finalized heuristics descriptor; asking for 0 elements only reports how
    // many there are.
    status("counting the heuristics' results", unsafe {
        sys::cudnnBackendGetAttribute(
            heuristics.0,
            Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            0,
            &mut count,
            null_mut(),
        )
    })?;
    if count <= 0 {
        return Ok(Vec::new());
    }
    let configs = (0..count)
        .map(|_| Desc::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>, _>>()?;
    let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
    let mut written = 0i64;
    // SAFETY: `raw` holds `count` engine-config descriptors just created, which cuDNN
    // fills in; it writes how many it filled into `written`.
    status("reading the heuristics' results", unsafe {
        sys::cudnnBackendGetAttribute(
            heuristics.0,
            Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            count,
            &mut written,
            raw.as_mut_ptr() as *mut c_void,
        )
    })?;
    let mut configs = configs;
    configs.truncate(written.clamp(0, count) as usize);
    Ok(configs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_follow_the_layout() {
        // N=2, C=3, H=4, W=5.
        assert_eq!(strides([2, 3, 4, 5], Layout::Nchw), [60, 20, 5, 1]);
        assert_eq!(strides([2, 3, 4, 5], Layout::Nhwc), [60, 1, 15, 3]);
    }
}
