//! The list of entry points the fake exports, as an enum: each export passes its own value to
//! the shared implementation, which counts the call. That keeps every export's machine code
//! distinct (LLVM would otherwise merge identical functions into one address, and two uprobes
//! on one address double-count) and names the call in trace output.

macro_rules! apis {
    ($($variant:ident = $name:literal,)*) => {
        /// One exported entry point.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(usize)]
        pub enum Api { $($variant,)* }

        impl Api {
            /// Every entry point, in declaration order.
            pub const ALL: &'static [Api] = &[$(Api::$variant,)*];
            /// Number of entry points.
            pub const COUNT: usize = Self::ALL.len();

            /// The exported symbol name.
            pub fn name(self) -> &'static str {
                match self { $(Api::$variant => $name,)* }
            }
        }
    };
}

apis! {
    Init = "cuInit",
    DriverGetVersion = "cuDriverGetVersion",
    DeviceGet = "cuDeviceGet",
    DeviceGetCount = "cuDeviceGetCount",
    DeviceGetName = "cuDeviceGetName",
    DeviceGetUuid = "cuDeviceGetUuid",
    DeviceGetUuidV2 = "cuDeviceGetUuid_v2",
    DeviceTotalMemV2 = "cuDeviceTotalMem_v2",
    DevicePrimaryCtxRetain = "cuDevicePrimaryCtxRetain",
    DevicePrimaryCtxRelease = "cuDevicePrimaryCtxRelease",
    DevicePrimaryCtxReleaseV2 = "cuDevicePrimaryCtxRelease_v2",
    CtxCreateV2 = "cuCtxCreate_v2",
    CtxCreateV4 = "cuCtxCreate_v4",
    CtxDestroyV2 = "cuCtxDestroy_v2",
    CtxSetCurrent = "cuCtxSetCurrent",
    CtxGetCurrent = "cuCtxGetCurrent",
    CtxGetDevice = "cuCtxGetDevice",
    MemAllocV2 = "cuMemAlloc_v2",
    MemAllocPitchV2 = "cuMemAllocPitch_v2",
    MemAllocManaged = "cuMemAllocManaged",
    MemFreeV2 = "cuMemFree_v2",
    MemGetInfoV2 = "cuMemGetInfo_v2",
    MemAllocAsync = "cuMemAllocAsync",
    MemAllocAsyncPtsz = "cuMemAllocAsync_ptsz",
    MemFreeAsync = "cuMemFreeAsync",
    MemFreeAsyncPtsz = "cuMemFreeAsync_ptsz",
    MemAllocFromPoolAsync = "cuMemAllocFromPoolAsync",
    MemAllocFromPoolAsyncPtsz = "cuMemAllocFromPoolAsync_ptsz",
    DeviceGetMemPool = "cuDeviceGetMemPool",
    MemPoolTrimTo = "cuMemPoolTrimTo",
    MemPoolGetAttribute = "cuMemPoolGetAttribute",
    MemCreate = "cuMemCreate",
    MemRelease = "cuMemRelease",
    MemAddressReserve = "cuMemAddressReserve",
    MemAddressFree = "cuMemAddressFree",
    MemMap = "cuMemMap",
    MemUnmap = "cuMemUnmap",
    MemSetAccess = "cuMemSetAccess",
    MemGetAllocationGranularity = "cuMemGetAllocationGranularity",
    // Arrays and graph memory (crate::resources).
    MemRetainAllocationHandle = "cuMemRetainAllocationHandle",
    ArrayCreateV2 = "cuArrayCreate_v2",
    Array3DCreateV2 = "cuArray3DCreate_v2",
    MipmappedArrayCreate = "cuMipmappedArrayCreate",
    ArrayDestroy = "cuArrayDestroy",
    MipmappedArrayDestroy = "cuMipmappedArrayDestroy",
    ArrayGetMemoryRequirements = "cuArrayGetMemoryRequirements",
    MipmappedArrayGetMemoryRequirements = "cuMipmappedArrayGetMemoryRequirements",
    GraphCreate = "cuGraphCreate",
    GraphAddMemAllocNode = "cuGraphAddMemAllocNode",
    GraphInstantiateWithFlags = "cuGraphInstantiateWithFlags",
    GraphLaunch = "cuGraphLaunch",
    GraphLaunchPtsz = "cuGraphLaunch_ptsz",
    DeviceGraphMemTrim = "cuDeviceGraphMemTrim",
    DeviceGetGraphMemAttribute = "cuDeviceGetGraphMemAttribute",
    GraphExecDestroy = "cuGraphExecDestroy",
    GraphDestroy = "cuGraphDestroy",
    GetProcAddress = "cuGetProcAddress",
    GetProcAddressV2 = "cuGetProcAddress_v2",
    GetErrorString = "cuGetErrorString",
    GetErrorName = "cuGetErrorName",
    CtxCreateV3 = "cuCtxCreate_v3",
    DeviceGetAttribute = "cuDeviceGetAttribute",
    DevicePrimaryCtxGetState = "cuDevicePrimaryCtxGetState",
    CtxPushCurrentV2 = "cuCtxPushCurrent_v2",
    CtxPopCurrentV2 = "cuCtxPopCurrent_v2",
    CtxGetFlags = "cuCtxGetFlags",
    CtxGetApiVersion = "cuCtxGetApiVersion",
    CtxGetStreamPriorityRange = "cuCtxGetStreamPriorityRange",
    CtxSynchronize = "cuCtxSynchronize",
    StreamCreate = "cuStreamCreate",
    StreamCreateWithPriority = "cuStreamCreateWithPriority",
    StreamDestroyV2 = "cuStreamDestroy_v2",
    StreamSynchronize = "cuStreamSynchronize",
    StreamQuery = "cuStreamQuery",
    EventCreate = "cuEventCreate",
    EventRecord = "cuEventRecord",
    EventQuery = "cuEventQuery",
    EventSynchronize = "cuEventSynchronize",
    EventDestroyV2 = "cuEventDestroy_v2",
    MemPoolCreate = "cuMemPoolCreate",
    MemPoolDestroy = "cuMemPoolDestroy",
    MemPoolSetAttribute = "cuMemPoolSetAttribute",
    DeviceGetDefaultMemPool = "cuDeviceGetDefaultMemPool",
    NvmlInitWithFlags = "nvmlInitWithFlags",
    NvmlSystemGetDriverVersion = "nvmlSystemGetDriverVersion",
    NvmlSystemGetCudaDriverVersion = "nvmlSystemGetCudaDriverVersion",
    NvmlSystemGetCudaDriverVersionV2 = "nvmlSystemGetCudaDriverVersion_v2",
    NvmlDeviceGetName = "nvmlDeviceGetName",
    NvmlDeviceGetIndex = "nvmlDeviceGetIndex",
    NvmlDeviceGetMinorNumber = "nvmlDeviceGetMinorNumber",
    NvmlDeviceGetComputeRunningProcessesV3 = "nvmlDeviceGetComputeRunningProcesses_v3",
    NvmlInit = "nvmlInit",
    NvmlInitV2 = "nvmlInit_v2",
    NvmlShutdown = "nvmlShutdown",
    NvmlDeviceGetCountV2 = "nvmlDeviceGetCount_v2",
    NvmlDeviceGetHandleByIndexV2 = "nvmlDeviceGetHandleByIndex_v2",
    NvmlDeviceGetUuid = "nvmlDeviceGetUUID",
    NvmlDeviceGetMemoryInfo = "nvmlDeviceGetMemoryInfo",
    NvmlDeviceGetMemoryInfoV2 = "nvmlDeviceGetMemoryInfo_v2",
    NvmlErrorString = "nvmlErrorString",
    NvmlDeviceSetMemoryLimitsV1 = "nvmlDeviceSetMemoryLimits_v1",
    NvmlDeviceGetMemoryLimitsV1 = "nvmlDeviceGetMemoryLimits_v1",
    DeviceUsage = "fakecuda_device_usage",
    ApiCalls = "fakecuda_api_calls",
    // External memory (crate::external).
    ImportExternalMemory = "cuImportExternalMemory",
    ExternalMemoryGetMappedBuffer = "cuExternalMemoryGetMappedBuffer",
    DestroyExternalMemory = "cuDestroyExternalMemory",
    // ---- graphs: capture, clones, child graphs, instantiation (crate::graphs) ----
    GraphAddChildGraphNode = "cuGraphAddChildGraphNode",
    GraphAddNode = "cuGraphAddNode",
    GraphAddNodeV2 = "cuGraphAddNode_v2",
    GraphClone = "cuGraphClone",
    GraphGetNodes = "cuGraphGetNodes",
    GraphNodeGetType = "cuGraphNodeGetType",
    GraphMemAllocNodeGetParams = "cuGraphMemAllocNodeGetParams",
    GraphChildGraphNodeGetGraph = "cuGraphChildGraphNodeGetGraph",
    GraphInstantiate = "cuGraphInstantiate",
    GraphInstantiateV2 = "cuGraphInstantiate_v2",
    GraphInstantiateWithParams = "cuGraphInstantiateWithParams",
    GraphInstantiateWithParamsPtsz = "cuGraphInstantiateWithParams_ptsz",
    GraphUpload = "cuGraphUpload",
    GraphUploadPtsz = "cuGraphUpload_ptsz",
    StreamBeginCaptureV2 = "cuStreamBeginCapture_v2",
    StreamBeginCaptureV2Ptsz = "cuStreamBeginCapture_v2_ptsz",
    StreamEndCapture = "cuStreamEndCapture",
    StreamEndCapturePtsz = "cuStreamEndCapture_ptsz",
    StreamIsCapturing = "cuStreamIsCapturing",
    StreamIsCapturingPtsz = "cuStreamIsCapturing_ptsz",
    // ---- end graphs ----
}
