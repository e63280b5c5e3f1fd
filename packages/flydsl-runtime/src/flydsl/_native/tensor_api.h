/* flydsl's tensor API for C extension modules: what a fast host path reads of a torch tensor, and a fresh
 * tensor like one, through torch's C++ API instead of its Python methods.
 *
 * tensor_api.cpp implements it (compiled against torch's headers: flydsl.native.tensor_api) and exports it
 * as a capsule named FLYDSL_TENSOR_API_CAPSULE; a C module given that capsule calls the functions below
 * where it would otherwise call x.is_cuda, x.is_contiguous(), x.shape, x.get_device(), x.requires_grad,
 * x.data_ptr(), x.dtype, torch.is_grad_enabled() and torch.empty_like(x), each through torch's argument
 * parser (~0.1-2 us each). A C source includes it as <flydsl/tensor_api.h>: flydsl.native.load pastes it in.
 */
#ifndef FLYDSL_TENSOR_API_H
#define FLYDSL_TENSOR_API_H

#include <Python.h>

#define FLYDSL_TENSOR_API_CAPSULE "flydsl.tensor_api.v1"
#define FLYDSL_TENSOR_MAX_DIMS 8

typedef struct {
    unsigned long long data_ptr;
    long long sizes[FLYDSL_TENSOR_MAX_DIMS];
    int ndim;
    int device;        /* the CUDA (or HIP) device index; -1 for a tensor on any other device */
    int contiguous;    /* contiguous in the default memory format, as x.is_contiguous() */
    int requires_grad;
    PyObject *dtype;   /* borrowed: the torch.dtype object */
} flydsl_tensor_info;

typedef struct {
    /* 1: *out filled. 0: obj is not a tensor this API reads (not a torch.Tensor, no storage, more than
     * FLYDSL_TENSOR_MAX_DIMS dimensions, a layout without strides); no error set. */
    int (*info)(PyObject *obj, flydsl_tensor_info *out);
    /* A new tensor of obj's shape, dtype, device and layout (torch.empty_like), its data pointer in
     * *data_ptr: a new reference, or NULL with an error set. */
    PyObject *(*empty_like)(PyObject *obj, unsigned long long *data_ptr);
    /* torch.is_grad_enabled() */
    int (*grad_enabled)(void);
} flydsl_tensor_api;

#endif
