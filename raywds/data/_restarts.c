/* Restart markers for `raywds convert`: a JPEG losslessly rewritten so that
 * raywds.loader._jpeg can cut it to a crop's rows and columns before decoding it (see cut_jpeg
 * there). The DCT coefficients are copied as they are, so every pixel decodes as before.
 *
 * raywds.data.convert uses it when it is built; without it the shards keep the JPEGs' own bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#include "jpeg_errors.h"

PyDoc_STRVAR(add_restarts_doc,
"add_restarts(data) -> bytes or None\n\n"
"The same JPEG, losslessly rewritten (its DCT coefficients copied, not re-encoded) as one\n"
"baseline scan (its own AC Huffman tables, libjpeg's standard DC tables; optimal ones for a\n"
"progressive JPEG) with a restart marker every k MCUs, k dividing an\n"
"MCU row into about 8 runs (one run a row when no such k exists), its other markers (EXIF, ICC,\n"
"comments) kept: raywds.loader._jpeg then cuts it to a box before decoding it, to\n"
"the same pixels. None for a JPEG they do not decode (CMYK, YCCK, 12-bit).\n"
"Raises ValueError for a JPEG libjpeg cannot read, or warns about (corrupt or truncated data).");

/* k for an MCU row of `per_row` MCUs: the divisor that makes the number of runs closest to 8,
 * the fewer markers on a tie, and never 1 for a row of more than one MCU (a marker after every
 * MCU costs more bytes than it saves time). A prime number of MCUs gets one run a row: its rows
 * can still be cut, its columns not. */
static unsigned run_length(unsigned per_row) {
    unsigned best = per_row;
    double best_off = (double)per_row; /* one run a row: 1 - 8, as far as it can be */
    for (unsigned k = 2; k < per_row; k++) {
        if (per_row % k != 0)
            continue;
        double off = (double)per_row / k - 8;
        if (off < 0) off = -off;
        if (off <= best_off) {
            best = k;
            best_off = off;
        }
    }
    return best;
}

/* A baseline JPEG of one scan: its AC Huffman tables, each component's as it was, for the
 * rewrite. The rewrite codes the same coefficients in the same order, so every AC symbol it
 * writes was in the source and has a code; only the DC differences change (a run starts from
 * zero), and libjpeg's standard DC tables, already set, have a code for every one. That saves
 * the pass that counts symbols for optimal tables (half of the rewrite's time); any other JPEG
 * gets optimal tables. Returns whether it kept them. */
static int keep_ac_tables(struct jpeg_decompress_struct *src, struct jpeg_compress_struct *dst) {
    if (src->progressive_mode || src->arith_code || src->input_scan_number != 1 || src->comps_in_scan != src->num_components)
        return 0;
    for (int c = 0; c < src->num_components; c++) {
        int n = src->comp_info[c].ac_tbl_no;
        if (n < 0 || n >= NUM_HUFF_TBLS || src->ac_huff_tbl_ptrs[n] == NULL)
            return 0;
    }
    for (int c = 0; c < src->num_components; c++) {
        int n = src->comp_info[c].ac_tbl_no;
        if (dst->ac_huff_tbl_ptrs[n] == NULL)
            dst->ac_huff_tbl_ptrs[n] = jpeg_alloc_huff_table((j_common_ptr)dst);
        memcpy(dst->ac_huff_tbl_ptrs[n]->bits, src->ac_huff_tbl_ptrs[n]->bits, sizeof src->ac_huff_tbl_ptrs[n]->bits);
        memcpy(dst->ac_huff_tbl_ptrs[n]->huffval, src->ac_huff_tbl_ptrs[n]->huffval, sizeof src->ac_huff_tbl_ptrs[n]->huffval);
        dst->ac_huff_tbl_ptrs[n]->sent_table = FALSE;
        dst->comp_info[c].ac_tbl_no = n;
    }
    return 1;
}

static PyObject *add_restarts(PyObject *self, PyObject *args) {
    Py_buffer data;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    struct error_mgr err, dst_err;
    unsigned char *out = NULL; /* address taken: survives a longjmp */
    unsigned long out_len = 0;
    volatile int dst_made = 0;
    src.err = catch_errors(&err);
    if (setjmp(err.jump)) { /* the reader's errors (it is also read while the writer writes) */
        PyObject *e = PyErr_Format(PyExc_ValueError, "JPEG: %s", err.message);
        if (dst_made)
            jpeg_destroy_compress(&dst);
        jpeg_destroy_decompress(&src);
        PyBuffer_Release(&data);
        free(out);
        return e;
    }
    jpeg_create_decompress(&src);
    jpeg_mem_src(&src, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
    for (int m = 0; m < 16; m++)
        jpeg_save_markers(&src, JPEG_APP0 + m, 0xFFFF);
    jpeg_read_header(&src, TRUE);
    if (!rgb_decodable(src.jpeg_color_space) || src.num_components > 3 || src.data_precision != 8) {
        jpeg_destroy_decompress(&src);
        PyBuffer_Release(&data);
        Py_RETURN_NONE;
    }
    unsigned per_row = src.num_components == 1 ? (src.image_width + 7) / 8
                                                : (src.image_width + 8 * src.max_h_samp_factor - 1) / (8 * src.max_h_samp_factor);
    unsigned k = run_length(per_row);
    jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&src);
    if (err.warning[0] != '\0') { /* libjpeg made up what it could not read */
        PyObject *e = PyErr_Format(PyExc_ValueError, "corrupt JPEG data: %s", err.warning);
        jpeg_destroy_decompress(&src);
        PyBuffer_Release(&data);
        return e;
    }
    if (setjmp(dst_err.jump)) { /* the writer's errors, from here on */
        PyObject *e = PyErr_Format(PyExc_ValueError, "JPEG: %s", dst_err.message);
        jpeg_destroy_compress(&dst);
        jpeg_destroy_decompress(&src);
        PyBuffer_Release(&data);
        free(out);
        return e;
    }
    dst.err = catch_errors(&dst_err);
    jpeg_create_compress(&dst);
    dst_made = 1;
    jpeg_mem_dest(&dst, &out, &out_len);
    jpeg_copy_critical_parameters(&src, &dst);
    dst.optimize_coding = !keep_ac_tables(&src, &dst);
    dst.restart_interval = k;
    jpeg_write_coefficients(&dst, coefficients);
    for (jpeg_saved_marker_ptr m = src.marker_list; m != NULL; m = m->next) {
        int jfif = m->marker == JPEG_APP0 && m->data_length >= 5 && memcmp(m->data, "JFIF", 5) == 0;
        int adobe = m->marker == JPEG_APP0 + 14 && m->data_length >= 5 && memcmp(m->data, "Adobe", 5) == 0;
        if ((jfif && dst.write_JFIF_header) || (adobe && dst.write_Adobe_marker))
            continue; /* libjpeg writes its own */
        jpeg_write_marker(&dst, m->marker, m->data, m->data_length);
    }
    jpeg_finish_compress(&dst);
    jpeg_finish_decompress(&src);
    jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    PyBuffer_Release(&data);
    PyObject *result = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)out_len);
    free(out);
    return result;
}

static PyMethodDef methods[] = {
    {"add_restarts", add_restarts, METH_VARARGS, add_restarts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_restarts", "Restart markers added to JPEGs losslessly (libjpeg-turbo).", -1, methods,
};

PyMODINIT_FUNC PyInit__restarts(void) { return PyModule_Create(&module); }
