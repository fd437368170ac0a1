/* A prepared call's hot path: the checks, pointer reads and driver launches of
 * fagen.decode.PreparedAttention.__call__ for PyTorch tensors, in C.
 *
 * Why: a decode step's host time is the driver's launch (3.6 us on an H200 host) plus the
 * interpreter's work around it (4.7 us there: the layout checks, data_ptr, the stream, the
 * Launch's slot stores and its ctypes call). Everything that reads a tensor still goes through
 * torch's Python bindings; what leaves is the bytecode between those calls.
 *
 * Built by fagen/hot_path.py with the host's C compiler against Python.h alone: no CUDA or
 * torch headers. The driver entry points come in as addresses (cuLaunchKernelEx,
 * cuStreamIsCapturing, cuTensorMapEncodeTiled), so a test can hand in recording callbacks instead.
 *
 * A TMA kernel reads a tensor's address from its map (a 128-byte parameter): a re-pointed tensor's
 * map is encoded here, by the driver, into the launch's slots (in Python it cost microseconds a
 * map); the address each map holds is shared with the Python path (Launch._mapped).
 *
 * A call that is not the fast case (another layout, dtype, device or out) returns
 * NotImplemented and launches nothing: the Python path then checks it again and raises its
 * message.
 *
 * A growing class (fagen.decode.GrowingKeys: a decode loop whose cache grows a token a call) takes
 * k and v of any length in [lo, hi) and any 16-byte-row strides: each call writes the kernel's
 * n_kv, diagonal offset, K/V strides and split share into its slots before the launch. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define MAX_LAUNCHES 3 /* a varlen batch's tile table, the kernel, the merge kernel after a split one */
#define MAX_INPUTS 8   /* q, k, v, a batch layout's index tensors (paged: cache_seqlens, page_table) and
                          an FP8 cache's descales read where they lie */
#define MAX_ADDRESSES (MAX_INPUTS + 2) /* the inputs, out, lse: what a call may re-point, in this order */
#define PROGRAMMATIC_STREAM_SERIALIZATION 6 /* CUlaunchAttributeID, cuda.h */
#define MAX_MAPS 4      /* a launch's tensor maps: q, k, v (the TMA producer's) */
#define MAP_BYTES 128   /* sizeof(CUtensorMap) */
#define MAX_MAP_RANK 5
#define GROWING_FIELDS 9 /* n_kv, mask_offset, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn[, kv_tiles_per_split] */

/* CUlaunchAttribute and CUlaunchConfig as cuda.h lays them out */
typedef struct {
    int id;
    char pad[4];
    unsigned value[16];
} LaunchAttribute;

typedef struct {
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem;
    void *stream;
    LaunchAttribute *attrs;
    unsigned num_attrs;
} LaunchConfig;

typedef int (*LaunchKernelEx)(const LaunchConfig *, void *function, void **params, void **extra);
typedef int (*StreamIsCapturing)(void *stream, int *status);
typedef int (*EncodeTiled)(void *map, int data_type, unsigned rank, void *address, const uint64_t *dims,
                           const uint64_t *strides, const unsigned *box, const unsigned *element_strides,
                           int interleave, int swizzle, int l2_promotion, int oob_fill);

/* one tensor map parameter: its first slot, the address it follows (an index into a call's
 * addresses) and what cuTensorMapEncodeTiled takes beside that address */
typedef struct {
    int slot, tensor, data_type;
    unsigned rank;
    uint64_t dims[MAX_MAP_RANK], strides[MAX_MAP_RANK - 1];
    unsigned box[MAX_MAP_RANK];
} MapEncoding;

typedef struct {
    LaunchConfig config;
    LaunchAttribute attribute;
    void *function;
    void **params;              /* the Launch's pointer array, one entry a parameter */
    uint64_t *values;           /* the Launch's 8-byte slots the pointers point into */
    Py_ssize_t value_count;     /* ... how many */
    int slots[MAX_ADDRESSES];   /* the slot each address goes to; -1: not a parameter */
    MapEncoding maps[MAX_MAPS];
    int map_count;
    uint64_t *mapped;           /* the address each map was last encoded for (Launch._mapped's buffer) */
} Launch;

typedef struct {
    PyObject_HEAD
    PyObject *layout;           /* (q.shape, q.stride(), k.shape, k.stride(), ...): each input's */
    char dense[MAX_INPUTS], out_dense;  /* an input's (out's) prepared strides are its shape's contiguous ones: then a
                                   tensor of that shape with is_contiguous() is laid out as prepared (a
                                   stride over a dimension of one is never stepped), one cheap call
                                   in place of stride()'s tuple and its comparison */
    PyObject *dtypes;           /* each input's dtype, then out's */
    PyObject *out_shape, *out_stride;
    int inputs;                 /* q, k, v and the index tensors: run's arguments before out */
    long device;
    PyObject *stream_of;        /* device -> the current stream's handle */
    PyObject *current_device;   /* () -> the calling thread's device */
    PyObject *allocate;         /* q -> out */
    PyObject *on_capture;       /* () : called once, the first call under stream capture */
    PyObject *keep;             /* the Launch objects whose buffers `launches` point into */
    uint64_t lse;
    LaunchKernelEx launch_kernel;
    StreamIsCapturing is_capturing;
    EncodeTiled encode_tiled;
    int map_flags[4];           /* interleave, swizzle, L2 promotion, out-of-bounds fill: every map's */
    int captured, launch_count, ready;  /* ready: init completed; run refuses otherwise */
    Launch launches[MAX_LAUNCHES];
    /* a growing class (growing != 0): k's and v's batch, heads and head_dim as prepared, their
     * length in [lo, hi); field_slots: where launches[0] (the kernel's: nothing launches before
     * it there) takes n_kv, mask_offset, the six K/V strides and (split kernels) the split share,
     * field_bytes: 4 (int) or 8 (long long) */
    int growing, fields, bottom_right;
    long long lo, hi, block_kv, splits, nq, kv_chunk, kv_dims[2][3];  /* kv_chunk: K's and V's elements a 16-byte
                                                                     copy; kv_dims: k's, then v's */
    int field_slots[GROWING_FIELDS], field_bytes[GROWING_FIELDS];
} HotPath;

static PyObject *SHAPE, *STRIDE, *DTYPE, *GET_DEVICE, *DATA_PTR, *IS_CONTIGUOUS;

static int same(PyObject *a, PyObject *b) {
    return a && b && PyObject_RichCompareBool(a, b, Py_EQ) == 1;
}

static int attribute_is(PyObject *tensor, PyObject *name, PyObject *expected) {
    PyObject *got = PyObject_GetAttr(tensor, name);
    int ok = same(got, expected);
    Py_XDECREF(got);
    return ok;
}

static int method_is(PyObject *tensor, PyObject *name, PyObject *expected) {
    PyObject *got = PyObject_CallMethodNoArgs(tensor, name);
    int ok = same(got, expected);
    Py_XDECREF(got);
    return ok;
}

static int device_is(PyObject *tensor, long device) {
    PyObject *got = PyObject_CallMethodNoArgs(tensor, GET_DEVICE);
    long value = got ? PyLong_AsLong(got) : -1;
    Py_XDECREF(got);
    return value == device;
}

/* t.data_ptr(), or 0 with the error set */
static uint64_t address_of(PyObject *tensor) {
    PyObject *got = PyObject_CallMethodNoArgs(tensor, DATA_PTR);
    uint64_t value = got ? (uint64_t)PyLong_AsUnsignedLongLong(got) : 0;
    Py_XDECREF(got);
    return value;
}

/* index i of a tuple of ints (torch.Size, a stride tuple), or -1 with the error set */
static long long item(PyObject *tuple, Py_ssize_t i) {
    return PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
}

/* input i's shape, strides, dtype and device as prepared: what makes the packed launch safe to reuse */
static int input_as_prepared(HotPath *self, PyObject *t, int i) {
    return attribute_is(t, SHAPE, PyTuple_GET_ITEM(self->layout, 2 * i))
        && (self->dense[i] ? method_is(t, IS_CONTIGUOUS, Py_True)
                           : method_is(t, STRIDE, PyTuple_GET_ITEM(self->layout, 2 * i + 1)))
        && attribute_is(t, DTYPE, PyTuple_GET_ITEM(self->dtypes, i)) && device_is(t, self->device);
}

static int laid_out_as_prepared(HotPath *self, PyObject *const *inputs) {
    for (int i = 0; i < self->inputs; i++)
        if (!input_as_prepared(self, inputs[i], i)) return 0;
    return 1;
}

/* whether strides are the contiguous ones of shape, as torch's is_contiguous() reads them
 * (dimensions of one skipped; no element: contiguous), or -1 with the error set */
static int contiguous(PyObject *shape, PyObject *strides) {
    if (!PyTuple_Check(shape) || !PyTuple_Check(strides) || PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(strides)) {
        PyErr_SetString(PyExc_ValueError, "HotPath: an input's layout is a shape and as many strides");
        return -1;
    }
    long long expected = 1, elements = 1;
    int dense = 1;
    for (Py_ssize_t d = PyTuple_GET_SIZE(shape) - 1; d >= 0; d--) {
        const long long size = item(shape, d), stride = item(strides, d);
        if (PyErr_Occurred()) return -1;
        elements *= size;
        if (size != 1) {
            dense &= stride == expected;
            expected *= size;
        }
    }
    return dense || elements == 0;
}

/* A growing class's k (input 1) or v (2): rank 4, batch, heads and head_dim as prepared, `length` rows (k's
 * sets it), 16-byte rows (last stride 1, the others multiples of kv_chunk elements: 8 of a half type, 16 of
 * an FP8 cache), dtype and device as prepared; its strides into strides[0..2]. */
static int kv_of_class(HotPath *self, PyObject *t, int input, long long *length, long long *strides) {
    PyObject *shape = PyObject_GetAttr(t, SHAPE), *stride = shape ? PyObject_CallMethodNoArgs(t, STRIDE) : NULL;
    int ok = shape && stride && PyTuple_Check(shape) && PyTuple_Check(stride) && PyTuple_GET_SIZE(shape) == 4
        && PyTuple_GET_SIZE(stride) == 4;
    for (int i = 0; ok && i < 3; i++) ok = item(shape, i == 2 ? 3 : i) == self->kv_dims[input - 1][i];
    if (ok) {
        long long n = item(shape, 2);
        if (*length < 0) *length = n;
        ok = n == *length && n >= self->lo && n < self->hi && item(stride, 3) == 1;
    }
    for (int i = 0; ok && i < 3; i++) {
        strides[i] = item(stride, i);
        ok = strides[i] % self->kv_chunk == 0;
    }
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return ok && !PyErr_Occurred() && attribute_is(t, DTYPE, PyTuple_GET_ITEM(self->dtypes, input))
        && device_is(t, self->device);
}

/* q and the index tensors as prepared, k and v of the class: then the kernel's length, diagonal,
 * strides and split share written for them (every call: the Python path writes them too) */
static int growing_as_prepared(HotPath *self, PyObject *const *inputs) {
    long long length = -1, strides[6];
    for (int i = 0; i < self->inputs; i++) {
        if (i == 1 || i == 2) {
            if (!kv_of_class(self, inputs[i], i, &length, strides + 3 * (i - 1))) return 0;
        } else if (!input_as_prepared(self, inputs[i], i)) {
            return 0;
        }
    }
    const long long tiles = (length + self->block_kv - 1) / self->block_kv;
    const long long values[GROWING_FIELDS] = {length, self->bottom_right ? length - self->nq : 0, strides[0],
                                              strides[1], strides[2], strides[3], strides[4], strides[5],
                                              (tiles + self->splits - 1) / self->splits};
    uint64_t *slots = self->launches[0].values;
    for (int i = 0; i < self->fields; i++)  /* an int's slot: its 4 bytes, then 4 zero bytes (struct's "i4x") */
        slots[self->field_slots[i]] = self->field_bytes[i] == 4 ? (uint64_t)(uint32_t)(int32_t)values[i]
                                                                : (uint64_t)values[i];
    return 1;
}

static int out_as_prepared(HotPath *self, PyObject *out) {
    return attribute_is(out, SHAPE, self->out_shape)
        && (self->out_dense ? method_is(out, IS_CONTIGUOUS, Py_True) : method_is(out, STRIDE, self->out_stride))
        && attribute_is(out, DTYPE, PyTuple_GET_ITEM(self->dtypes, self->inputs)) && device_is(out, self->device);
}

/* the maps of the tensors this call moved, encoded into their slots */
static int encode_maps(HotPath *self, Launch *launch, const uint64_t *addresses) {
    static const unsigned every[MAX_MAP_RANK] = {1, 1, 1, 1, 1};  /* every element of the box, no stepping */
    for (int i = 0; i < launch->map_count; i++) {
        const MapEncoding *m = &launch->maps[i];
        const uint64_t address = addresses[m->tensor];
        if (launch->mapped[i] == address) continue;
        _Alignas(64) unsigned char map[MAP_BYTES];  /* the driver writes a 64-byte-aligned map */
        int status = self->encode_tiled(map, m->data_type, m->rank, (void *)(uintptr_t)address, m->dims, m->strides,
                                        m->box, every, self->map_flags[0], self->map_flags[1], self->map_flags[2],
                                        self->map_flags[3]);
        if (status) {
            char why[96];  /* (PyErr_Format has no 64-bit hex) */
            snprintf(why, sizeof why, "cuTensorMapEncodeTiled refused the tensor at %#llx (CUresult %d)",
                     (unsigned long long)address, status);
            PyErr_SetString(PyExc_ValueError, why);
            return -1;
        }
        memcpy(launch->values + m->slot, map, MAP_BYTES);
        launch->mapped[i] = address;
    }
    return 0;
}

static int launch_one(HotPath *self, Launch *launch, void *stream, const uint64_t *addresses) {
    const int count = self->inputs + 2;
    for (int i = 0; i < count; i++)
        if (launch->slots[i] >= 0) launch->values[launch->slots[i]] = addresses[i];
    launch->config.stream = stream;
    int status = self->launch_kernel(&launch->config, launch->function, launch->params, NULL);
    if (status) {
        PyErr_Format(PyExc_RuntimeError, "cuLaunchKernelEx failed: CUresult %d", status);
        return -1;
    }
    return 0;
}

/* run(q, k, v, [index tensors,] out): out (allocated where None) after the launches;
 * NotImplemented where the tensors are not as prepared, or q, k, v or out is not 16-byte aligned */
static PyObject *HotPath_run(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "HotPath: not initialised");
        return NULL;
    }
    if (nargs != self->inputs + 1) Py_RETURN_NOTIMPLEMENTED;  /* the Python path says what it takes */
    PyObject *device = PyObject_CallNoArgs(self->current_device);
    if (!device) return NULL;
    long current = PyLong_AsLong(device);
    Py_DECREF(device);
    if (current != self->device || !(self->growing ? growing_as_prepared(self, args) : laid_out_as_prepared(self, args))) {
        PyErr_Clear();  /* a check that raised (not a torch tensor): the Python path says why */
        Py_RETURN_NOTIMPLEMENTED;
    }
    uint64_t addresses[MAX_ADDRESSES];
    for (int i = 0; i < self->inputs; i++) {
        addresses[i] = address_of(args[i]);
        if (PyErr_Occurred()) return NULL;
    }
    /* q, k and v are copied 16 bytes at a time (cp.async, TMA): another alignment is the Python
     * path's to refuse by name (a view whose last axis starts mid-row has the prepared strides).
     * MLA's inputs are q, the latent cache and the page table: a table view off 16 bytes takes
     * the Python path too (a few microseconds), never a wrong launch */
    if ((addresses[0] | addresses[1] | addresses[2]) % 16) Py_RETURN_NOTIMPLEMENTED;
    PyObject *out = args[self->inputs];
    if (out == Py_None) {
        out = PyObject_CallOneArg(self->allocate, args[0]);
        if (!out) return NULL;
    } else if (out_as_prepared(self, out)) {
        Py_INCREF(out);
    } else {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    addresses[self->inputs] = address_of(out);
    if (PyErr_Occurred()) goto fail;
    if (addresses[self->inputs] % 16) {
        Py_DECREF(out);
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *handle = PyObject_CallOneArg(self->stream_of, PyTuple_GET_ITEM(self->keep, 0));
    if (!handle) goto fail;
    void *stream = PyLong_AsVoidPtr(handle);
    Py_DECREF(handle);
    if (PyErr_Occurred()) goto fail;
    if (!self->captured) {  /* a graph captured now replays into the owner's workspace: keep it */
        int status = 0;
        if (self->is_capturing(stream, &status)) {
            PyErr_SetString(PyExc_RuntimeError, "cuStreamIsCapturing failed");
            goto fail;
        }
        if (status) {
            PyObject *kept = PyObject_CallNoArgs(self->on_capture);
            if (!kept) goto fail;
            Py_DECREF(kept);
            self->captured = 1;
        }
    }
    addresses[self->inputs + 1] = self->lse;
    for (int i = 0; i < self->launch_count; i++)  /* every map first: a refused one launches nothing */
        if (encode_maps(self, &self->launches[i], addresses)) goto fail;
    for (int i = 0; i < self->launch_count; i++)
        if (launch_one(self, &self->launches[i], stream, addresses)) goto fail;
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* growing: (lo, hi, block_kv, splits, nq, bottom_right, kv_chunk, k's and v's (B, Hkv, d), ((slot, bytes), ...)),
 * the fields in GROWING_FIELDS' order (the split share only for a split kernel) */
static int growing_init(HotPath *self, PyObject *growing) {
    PyObject *fields;
    long long (*dims)[3] = self->kv_dims;
    if (!PyArg_ParseTuple(growing, "LLLLLpL(LLL)(LLL)O!", &self->lo, &self->hi, &self->block_kv, &self->splits,
                          &self->nq, &self->bottom_right, &self->kv_chunk, &dims[0][0], &dims[0][1], &dims[0][2],
                          &dims[1][0], &dims[1][1], &dims[1][2], &PyTuple_Type, &fields))
        return -1;
    const Py_ssize_t count = PyTuple_GET_SIZE(fields);
    if (self->inputs < 3 || count < GROWING_FIELDS - 1 || count > GROWING_FIELDS || self->block_kv < 1
            || self->splits < 1 || (self->kv_chunk != 8 && self->kv_chunk != 16)) {
        PyErr_SetString(PyExc_ValueError, "HotPath: a growing class writes n_kv, mask_offset, six strides and "
                        "(split) the share, over key tiles and splits of at least 1, K and V copied in 16-byte "
                        "chunks of 8 or 16 elements");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int slot, bytes;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fields, i), "ii", &slot, &bytes)) return -1;
        if (slot < 0 || slot >= self->launches[0].value_count || (bytes != 4 && bytes != 8)) {
            PyErr_Format(PyExc_ValueError, "HotPath: field %zd at slot %d of %d bytes (the kernel's launch has %zd "
                         "slots)", i, slot, bytes, self->launches[0].value_count);
            return -1;
        }
        self->field_slots[i] = slot;
        self->field_bytes[i] = bytes;
    }
    self->fields = (int)count;
    self->growing = 1;
    return 0;
}

/* maps: None, or (the address of `count` uint64 mapped addresses, ((slot, tensor, data type, dims,
 * strides, box), ... `count` of them)) */
static int maps_init(Launch *launch, PyObject *maps, int addresses) {
    if (maps == Py_None) return 0;
    unsigned long long mapped;
    PyObject *encodings;
    if (!PyArg_ParseTuple(maps, "KO!", &mapped, &PyTuple_Type, &encodings)) return -1;
    const Py_ssize_t count = PyTuple_GET_SIZE(encodings);
    if (count > MAX_MAPS) {
        PyErr_Format(PyExc_ValueError, "HotPath: %zd tensor maps; at most %d", count, MAX_MAPS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        MapEncoding *m = &launch->maps[i];
        PyObject *dims, *strides, *box;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(encodings, i), "iiiO!O!O!", &m->slot, &m->tensor, &m->data_type,
                              &PyTuple_Type, &dims, &PyTuple_Type, &strides, &PyTuple_Type, &box))
            return -1;
        const Py_ssize_t rank = PyTuple_GET_SIZE(dims);
        if (rank < 1 || rank > MAX_MAP_RANK || PyTuple_GET_SIZE(strides) != rank - 1 || PyTuple_GET_SIZE(box) != rank
                || m->slot < 0 || m->slot + MAP_BYTES / 8 > launch->value_count || m->tensor < 0 || m->tensor >= addresses) {
            PyErr_SetString(PyExc_ValueError, "HotPath: a map of rank 1-5 (its strides one fewer, its box as many), "
                            "its 128 bytes within the launch's slots, following one of the call's addresses");
            return -1;
        }
        m->rank = (unsigned)rank;
        for (Py_ssize_t j = 0; j < rank; j++) {
            m->dims[j] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(dims, j));
            m->box[j] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(box, j));
            if (j < rank - 1) m->strides[j] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(strides, j));
        }
        if (PyErr_Occurred()) return -1;
    }
    launch->mapped = (uint64_t *)(uintptr_t)mapped;
    launch->map_count = (int)count;
    return 0;
}

/* HotPath(layout, dtypes, device, out_shape, out_stride, stream_of, current_device, allocate,
 *         on_capture, lse, launch_kernel, is_capturing, encode_tiled, map_flags, launches): launches
 * a tuple of (function, (grid x, y, z), threads, smem, dependent, params, values, value slots,
 * slots, maps, owner): owner keeps alive what params, values, the mapped addresses and the call's
 * addresses point at; map_flags: (interleave, swizzle, L2 promotion, out-of-bounds fill) */
static int HotPath_init(HotPath *self, PyObject *args, PyObject *kwargs) {
    PyObject *layout, *dtypes, *out_shape, *out_stride, *stream_of, *current_device, *allocate, *on_capture;
    PyObject *launches, *growing = Py_None;
    long device;
    unsigned long long lse, launch_kernel, is_capturing, encode_tiled;
    if (self->keep) {
        PyErr_SetString(PyExc_RuntimeError, "HotPath: initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!O!lOOOOOOKKKK(iiii)O!|O", &PyTuple_Type, &layout, &PyTuple_Type, &dtypes, &device,
                          &out_shape, &out_stride, &stream_of, &current_device, &allocate, &on_capture, &lse,
                          &launch_kernel, &is_capturing, &encode_tiled, &self->map_flags[0], &self->map_flags[1],
                          &self->map_flags[2], &self->map_flags[3], &PyTuple_Type, &launches, &growing))
        return -1;
    const Py_ssize_t inputs = PyTuple_GET_SIZE(dtypes) - 1;  /* dtypes: each input's, then out's */
    if (inputs < 3 || inputs > MAX_INPUTS || PyTuple_GET_SIZE(layout) != 2 * inputs
            || PyTuple_GET_SIZE(launches) < 1 || PyTuple_GET_SIZE(launches) > MAX_LAUNCHES) {
        PyErr_SetString(PyExc_ValueError, "HotPath: 3-8 inputs (q, k, v, index tensors, descales), a (shape, strides) pair and a dtype each, out's "
                        "dtype, and 1-3 launches");
        return -1;
    }
    self->inputs = (int)inputs;
    for (int i = 0; i < self->inputs; i++) {
        const int dense = contiguous(PyTuple_GET_ITEM(layout, 2 * i), PyTuple_GET_ITEM(layout, 2 * i + 1));
        if (dense < 0) return -1;
        self->dense[i] = (char)dense;
    }
    const int out_dense = contiguous(out_shape, out_stride);
    if (out_dense < 0) return -1;
    self->out_dense = (char)out_dense;
    /* keep: the device as an int object (stream_of's argument), then every launch's owner */
    self->keep = PyTuple_New(1 + PyTuple_GET_SIZE(launches));
    if (!self->keep) return -1;
    PyObject *device_object = PyLong_FromLong(device);
    if (!device_object) return -1;
    PyTuple_SET_ITEM(self->keep, 0, device_object);
    self->layout = Py_NewRef(layout);
    self->dtypes = Py_NewRef(dtypes);
    self->out_shape = Py_NewRef(out_shape);
    self->out_stride = Py_NewRef(out_stride);
    self->stream_of = Py_NewRef(stream_of);
    self->current_device = Py_NewRef(current_device);
    self->allocate = Py_NewRef(allocate);
    self->on_capture = Py_NewRef(on_capture);
    self->device = device;
    self->lse = lse;
    self->launch_kernel = (LaunchKernelEx)(uintptr_t)launch_kernel;
    self->is_capturing = (StreamIsCapturing)(uintptr_t)is_capturing;
    self->encode_tiled = (EncodeTiled)(uintptr_t)encode_tiled;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(launches); i++) {
        Launch *launch = &self->launches[i];
        unsigned long long function, params, values;
        int dependent;
        Py_ssize_t value_slots;
        PyObject *slots, *maps, *owner;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(launches, i), "K(III)IIpKKnO!OO", &function,
                              &launch->config.grid_x, &launch->config.grid_y, &launch->config.grid_z,
                              &launch->config.block_x, &launch->config.smem, &dependent, &params, &values,
                              &value_slots, &PyTuple_Type, &slots, &maps, &owner))
            return -1;
        if (PyTuple_GET_SIZE(slots) != inputs + 2) {
            PyErr_SetString(PyExc_ValueError, "HotPath: a launch's slots are the inputs', out's and lse's");
            return -1;
        }
        for (int j = 0; j < inputs + 2; j++) {
            long slot = PyLong_AsLong(PyTuple_GET_ITEM(slots, j));
            if (slot == -1 && PyErr_Occurred()) return -1;
            if (slot < -1 || slot >= value_slots) {  /* a store past the Launch's buffer */
                PyErr_Format(PyExc_ValueError, "HotPath: slot %ld outside the launch's %zd", slot, value_slots);
                return -1;
            }
            launch->slots[j] = (int)slot;
        }
        launch->config.block_y = launch->config.block_z = 1;
        launch->attribute.id = PROGRAMMATIC_STREAM_SERIALIZATION;
        launch->attribute.value[0] = 1;
        launch->config.attrs = dependent ? &launch->attribute : NULL;
        launch->config.num_attrs = dependent ? 1 : 0;
        launch->function = (void *)(uintptr_t)function;
        launch->params = (void **)(uintptr_t)params;
        launch->values = (uint64_t *)(uintptr_t)values;
        launch->value_count = value_slots;
        PyTuple_SET_ITEM(self->keep, 1 + i, Py_NewRef(owner));
        self->launch_count = (int)i + 1;  /* dealloc releases what is set */
        if (maps_init(launch, maps, (int)inputs + 2)) return -1;
    }
    if (growing != Py_None && growing_init(self, growing)) return -1;
    self->ready = 1;
    return 0;
}

static void HotPath_dealloc(HotPath *self) {
    Py_XDECREF(self->layout);
    Py_XDECREF(self->dtypes);
    Py_XDECREF(self->out_shape);
    Py_XDECREF(self->out_stride);
    Py_XDECREF(self->stream_of);
    Py_XDECREF(self->current_device);
    Py_XDECREF(self->allocate);
    Py_XDECREF(self->on_capture);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *HotPath_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    return type->tp_alloc(type, 0);  /* zeroed: dealloc is safe before init succeeds */
}

static PyMethodDef HotPath_methods[] = {
    {"run", (PyCFunction)(void (*)(void))HotPath_run, METH_FASTCALL,
     "run(q, k, v, [index tensors,] out): out after the launches, or NotImplemented where the tensors are not as prepared"},
    {NULL}};

static PyTypeObject HotPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fagen_hot_path.HotPath",
    .tp_basicsize = sizeof(HotPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A prepared call's checks and launches, for PyTorch tensors",
    .tp_new = HotPath_new,
    .tp_init = (initproc)HotPath_init,
    .tp_dealloc = (destructor)HotPath_dealloc,
    .tp_methods = HotPath_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fagen_hot_path", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_fagen_hot_path(void) {
    if (PyType_Ready(&HotPathType) < 0) return NULL;
    SHAPE = PyUnicode_InternFromString("shape");
    STRIDE = PyUnicode_InternFromString("stride");
    DTYPE = PyUnicode_InternFromString("dtype");
    GET_DEVICE = PyUnicode_InternFromString("get_device");
    DATA_PTR = PyUnicode_InternFromString("data_ptr");
    IS_CONTIGUOUS = PyUnicode_InternFromString("is_contiguous");
    if (!SHAPE || !STRIDE || !DTYPE || !GET_DEVICE || !DATA_PTR || !IS_CONTIGUOUS) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&HotPathType);
    if (PyModule_AddObject(m, "HotPath", (PyObject *)&HotPathType) < 0) {
        Py_DECREF(&HotPathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
