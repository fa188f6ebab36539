/* Region-of-interest JPEG decoding with libjpeg(-turbo): decode only the rows and iMCU
 * columns a crop covers, optionally DCT-scaled by 1/2, 1/4 or 1/8.
 *
 * Rows above the crop are skipped (jpeg_skip_scanlines: entropy-decoded, not IDCT'd or
 * colour-converted), rows below it are never read, and columns outside it are not
 * IDCT'd or colour-converted (jpeg_crop_scanline). Needs libjpeg-turbo >= 1.5.1.
 *
 * raywds.loader.crops uses it when it is built and falls back to torchvision.io.decode_jpeg.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#include "../data/jpeg_errors.h"

/* After the caller's setjmp: a decompressor over `data`, its header read. */
static void read_header(struct jpeg_decompress_struct *cinfo, const Py_buffer *data) {
    jpeg_create_decompress(cinfo);
    jpeg_mem_src(cinfo, (const unsigned char *)data->buf, (unsigned long)data->len);
    jpeg_read_header(cinfo, TRUE);
}

/* Scanlines asked of libjpeg at once. One at a time, its upsampler and colour converter
 * do part of each call's work twice for 4:2:0 JPEGs (two output rows a chroma row): 16 rows (an
 * iMCU row of such a JPEG) decode a whole image 9% faster and a training crop's region 6% faster,
 * the same pixels. */
#define ROWS_AT_ONCE 16

static JDIMENSION floor_div(long a, long b) { return (JDIMENSION)(a / b); }
static JDIMENSION ceil_div(long a, long b) { return (JDIMENSION)((a + b - 1) / b); }

/* Cutting a JPEG to a box before decoding it.
 *
 * In a baseline JPEG with a restart marker every k MCUs, k dividing an MCU row (what
 * `raywds convert` writes: raywds.data._restarts), each run of k MCUs between two markers is coded
 * on its own: the DC predictions restart at zero and the run starts on a byte. The MCU rows and
 * column runs that cover a box (and the chroma samples beside it, which upsampling reads) can
 * then be copied out as a smaller JPEG of their own, its markers renumbered, and libjpeg
 * entropy-decodes only those instead of every row above the box at full width. The pixels are
 * the same as the whole image's: every block keeps its coefficients, and every pixel of the box
 * keeps the chroma samples its upsampling reads. Any other JPEG is decoded as it is. */

struct cut {
    unsigned char *data; /* the smaller JPEG (PyMem_RawMalloc), NULL when there is none */
    size_t len;
    long dy, dx;         /* where it starts in the whole image, in pixels (0 without a cut) */
};

static unsigned read16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* The box's smaller JPEG in cut->data, or cut->data NULL (no restart markers to cut at, nothing
 * to gain, or anything unexpected: the caller decodes the original, which reports any damage).
 * Returns -1 only when memory ran out. */
static int cut_jpeg(const unsigned char *data, size_t len, long top, long left, long height, long width, int scale,
                    struct cut *cut) {
    cut->data = NULL;
    cut->dy = cut->dx = 0;
    size_t i = 2, sof = 0, start = 0;
    unsigned image_h = 0, image_w = 0, ncomp = 0, hmax = 1, vmax = 1, k = 0;
    if (len < 4 || data[0] != 0xFF || data[1] != 0xD8)
        return 0;
    while (start == 0) { /* the markers up to the start of the scan */
        if (i + 4 > len || data[i] != 0xFF)
            return 0;
        unsigned marker = data[i + 1];
        if (marker == 0xFF) { /* fill byte */
            i++;
            continue;
        }
        size_t seglen = read16(data + i + 2);
        if (seglen < 2 || i + 2 + seglen > len)
            return 0;
        const unsigned char *p = data + i + 4;
        if (marker == 0xC0 || marker == 0xC1) { /* baseline or extended sequential, Huffman */
            if (seglen < 8 || p[0] != 8)
                return 0;
            sof = i;
            image_h = read16(p + 1);
            image_w = read16(p + 3);
            ncomp = p[5];
            if (seglen < 8 + 3 * ncomp)
                return 0;
            for (unsigned c = 0; c < ncomp; c++) {
                unsigned h = p[6 + 3 * c + 1] >> 4, v = p[6 + 3 * c + 1] & 15;
                if (h > hmax) hmax = h;
                if (v > vmax) vmax = v;
            }
        } else if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC)) {
            return 0; /* progressive, lossless or arithmetic-coded */
        } else if (marker == 0xDD && seglen >= 4) {
            k = read16(p);
        } else if (marker == 0xDA) {
            if (sof == 0 || p[0] != ncomp) /* one scan with every component */
                return 0;
            start = i + 2 + seglen;
        }
        i += 2 + seglen;
    }
    if (ncomp == 1)
        hmax = vmax = 1; /* a one-component scan's MCU is one block */
    long mcu_h = 8 * (long)vmax, mcu_w = 8 * (long)hmax;
    if (k == 0 || image_h == 0 || top + height > (long)image_h || left + width > (long)image_w)
        return 0;
    long per_row = ((long)image_w + mcu_w - 1) / mcu_w, mcu_rows = ((long)image_h + mcu_h - 1) / mcu_h;
    if (per_row % k != 0)
        return 0;
    long runs = per_row / k; /* runs of k MCUs in a row */
    /* The MCUs under the box widened by `margin` pixels: fancy chroma upsampling makes a pixel
     * from the chroma samples beside its own, one chroma sample (2 pixels, 2 x scale at 1/scale)
     * away. Inside the cut those are the same samples as in the whole image. */
    long margin = 2L * scale;
    long r0 = top > margin ? (top - margin) / mcu_h : 0, r1 = (top + height + margin + mcu_h - 1) / mcu_h;
    long c0 = left > margin ? (left - margin) / mcu_w : 0, c1 = (left + width - 1 + margin) / mcu_w;
    if (r1 > mcu_rows) r1 = mcu_rows;
    if (c1 > per_row - 1) c1 = per_row - 1;
    c0 /= k;
    c1 = c1 / k + 1; /* runs c0 .. c1 - 1 */
    if (r0 == 0 && r1 == mcu_rows && c0 == 0 && c1 == runs)
        return 0;

    /* Where each run starts and ends, up to the last one the box needs. */
    long needed = r1 * runs, found = 0;
    size_t *bounds = PyMem_RawMalloc(sizeof(size_t) * 2 * (size_t)needed);
    if (bounds == NULL)
        return -1;
    size_t at = start;
    bounds[0] = start;
    while (found < needed) {
        const unsigned char *ff = memchr(data + at, 0xFF, len - at);
        if (ff == NULL || (size_t)(ff - data) + 1 >= len)
            break;
        size_t pos = (size_t)(ff - data);
        unsigned next = data[pos + 1];
        if (next == 0x00 || next == 0xFF) { /* a stuffed 0xFF in the data, or a fill byte */
            at = pos + 1;
            continue;
        }
        bounds[2 * found + 1] = pos; /* this run ends at a marker: a restart marker or the end */
        found++;
        if (next < 0xD0 || next > 0xD7 || (long)(next - 0xD0) != (found - 1) % 8)
            break;
        if (found < needed)
            bounds[2 * found] = pos + 2;
        at = pos + 2;
    }
    if (found < needed) { /* fewer runs than the header promises: let libjpeg report it */
        PyMem_RawFree(bounds);
        return 0;
    }

    size_t size = start + 2;
    for (long r = r0; r < r1; r++)
        for (long c = c0; c < c1; c++)
            size += bounds[2 * (r * runs + c) + 1] - bounds[2 * (r * runs + c)] + 2;
    unsigned char *out = PyMem_RawMalloc(size);
    if (out == NULL) {
        PyMem_RawFree(bounds);
        return -1;
    }
    memcpy(out, data, start);
    unsigned cut_h = r1 < mcu_rows ? (unsigned)((r1 - r0) * mcu_h) : image_h - (unsigned)(r0 * mcu_h);
    unsigned cut_w = c1 < runs ? (unsigned)((c1 - c0) * k * mcu_w) : image_w - (unsigned)(c0 * k * mcu_w);
    out[sof + 5] = (unsigned char)(cut_h >> 8);
    out[sof + 6] = (unsigned char)cut_h;
    out[sof + 7] = (unsigned char)(cut_w >> 8);
    out[sof + 8] = (unsigned char)cut_w;
    size_t o = start;
    long n = 0;
    for (long r = r0; r < r1; r++)
        for (long c = c0; c < c1; c++, n++) {
            if (n > 0) {
                out[o++] = 0xFF;
                out[o++] = (unsigned char)(0xD0 + (n - 1) % 8);
            }
            size_t b = bounds[2 * (r * runs + c)], e = bounds[2 * (r * runs + c) + 1];
            memcpy(out + o, data + b, e - b);
            o += e - b;
        }
    out[o++] = 0xFF;
    out[o++] = 0xD9;
    PyMem_RawFree(bounds);
    cut->data = out;
    cut->len = o;
    cut->dy = r0 * mcu_h;
    cut->dx = c0 * k * mcu_w;
    return 0;
}

PyDoc_STRVAR(decode_region_doc,
"decode_region(data, top, left, height, width, scale) -> (pixels, top, left, height, width)\n\n"
"Decode the part of a JPEG (RGB or grayscale) that covers the box (top, left, height, width,\n"
"in full-image pixels) at 1/scale size (scale 1, 2, 4 or 8), as RGB.\n"
"Returns the pixels (a bytearray, height x width x 3) and where they sit in the 1/scale image:\n"
"the region covers the scaled box, widened to whole iMCU columns on the left and right.\n"
"Raises ValueError for a broken JPEG, and for one libjpeg warns about while decoding the\n"
"region (corrupt data, a premature end): its pixels would be partly made up.");

PyDoc_STRVAR(decode_box_doc,
"decode_box(data, top, left, height, width) -> pixels\n\n"
"Exactly the box's pixels (top, left, height, width) of a JPEG (RGB or grayscale) at full\n"
"size, as one contiguous RGB bytearray, height x width x 3: what decode_region(..., 1) gives,\n"
"cut to the box while decoding, row by row, instead of in a copy afterwards.\n"
"Raises ValueError as decode_region does.");

/* Decode the box (full-image pixels) at 1/scale. `exact` (scale 1 only): the result is just the
 * box's pixels, each decoded row cut to the box as it comes out of libjpeg; else the rows of
 * the region decode_region describes, with where they start. */
static PyObject *decode(PyObject *args, int exact) {
    Py_buffer data;
    long top, left, height, width;
    int scale = 1;
    if (exact ? !PyArg_ParseTuple(args, "y*llll", &data, &top, &left, &height, &width)
              : !PyArg_ParseTuple(args, "y*lllli", &data, &top, &left, &height, &width, &scale))
        return NULL;
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "scale must be 1, 2, 4 or 8, not %d", scale);
    }
    if (top < 0 || left < 0 || height <= 0 || width <= 0) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "bad box (%ld, %ld, %ld, %ld)", top, left, height, width);
    }

    struct cut cut;
    if (cut_jpeg((const unsigned char *)data.buf, (size_t)data.len, top, left, height, width, scale, &cut) < 0) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    if (cut.data != NULL) { /* decode the smaller JPEG, the box moved into it */
        PyBuffer_Release(&data);
        PyBuffer_FillInfo(&data, NULL, cut.data, (Py_ssize_t)cut.len, 1, PyBUF_SIMPLE);
        top -= cut.dy;
        left -= cut.dx;
    }

    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
    JSAMPROW scratch = NULL; /* exact: ROWS_AT_ONCE decoded rows, before they are cut to the box */
    cinfo.err = catch_errors(&err);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyMem_RawFree(cut.data);
        return PyErr_Format(PyExc_ValueError, "JPEG: %s", err.message);
    }
    read_header(&cinfo, &data);
    if (!rgb_decodable(cinfo.jpeg_color_space)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyMem_RawFree(cut.data);
        return PyErr_Format(PyExc_ValueError, "JPEG colour space %d is not RGB, YCbCr or grayscale", (int)cinfo.jpeg_color_space);
    }
    if (top + height > (long)cinfo.image_height || left + width > (long)cinfo.image_width) {
        long w = cinfo.image_width, h = cinfo.image_height;
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyMem_RawFree(cut.data);
        return PyErr_Format(PyExc_ValueError, "box (%ld, %ld, %ld, %ld) outside the %ldx%ld image", top, left, height, width, w, h);
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale;
    jpeg_start_decompress(&cinfo);

    /* The box in the scaled image, widened to whole pixels and by one more column on each side
     * (fancy chroma upsampling of an edge column needs its neighbour, which the edge of a
     * cropped scanline would only replicate), clipped to the scaled image. */
    JDIMENSION y0 = floor_div(top, scale), y1 = ceil_div(top + height, scale);
    JDIMENSION x0 = floor_div(left, scale), x1 = ceil_div(left + width, scale) + 1;
    if (x0 > 0) x0 -= 1;
    if (x1 < x0 + 3) x1 = x0 + 3; /* a crop 2 pixels wide (1 chroma sample) upsamples wrong */
    if (y1 > cinfo.output_height) y1 = cinfo.output_height;
    if (x1 > cinfo.output_width) x1 = cinfo.output_width;
    JDIMENSION xoffset = x0, xwidth = x1 - x0;
    if (xwidth < cinfo.output_width)
        jpeg_crop_scanline(&cinfo, &xoffset, &xwidth); /* widens to iMCU boundaries */

    Py_ssize_t stride = (Py_ssize_t)cinfo.output_width * cinfo.output_components; /* after the crop */
    JDIMENSION rows = y1 - y0;
    Py_ssize_t out_stride = exact ? (Py_ssize_t)width * 3 : stride;
    Py_ssize_t skip = exact ? (Py_ssize_t)(left - (long)xoffset) * 3 : 0; /* bytes of a row left of the box */
    PyObject *pixels = PyByteArray_FromStringAndSize(NULL, out_stride * rows);
    if (exact && pixels != NULL && (scratch = (JSAMPROW)PyMem_RawMalloc((size_t)stride * ROWS_AT_ONCE)) == NULL) {
        Py_DECREF(pixels);
        pixels = PyErr_NoMemory();
    }
    if (pixels == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyMem_RawFree(cut.data);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyByteArray_AS_STRING(pixels);
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = setjmp(err.jump);
    if (!failed) {
        if (y0 > 0)
            jpeg_skip_scanlines(&cinfo, y0);
        JSAMPROW rows[ROWS_AT_ONCE];
        while (cinfo.output_scanline < y1) {
            JDIMENSION first = cinfo.output_scanline, count = y1 - first;
            if (count > ROWS_AT_ONCE)
                count = ROWS_AT_ONCE;
            for (JDIMENSION i = 0; i < count; i++) /* exact: into scratch; else straight into place */
                rows[i] = exact ? scratch + (Py_ssize_t)i * stride : out + (Py_ssize_t)(first + i - y0) * out_stride;
            JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, count);
            if (exact)
                for (JDIMENSION i = 0; i < got; i++)
                    memcpy(out + (Py_ssize_t)(first + i - y0) * out_stride, rows[i] + skip, (size_t)out_stride);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    if (failed) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyMem_RawFree(cut.data);
        Py_DECREF(pixels);
        return PyErr_Format(PyExc_ValueError, "JPEG: %s", err.message);
    }
    JDIMENSION out_width = cinfo.output_width;
    jpeg_destroy_decompress(&cinfo); /* the rows below the box are never decoded */
    PyBuffer_Release(&data);
    PyMem_RawFree(cut.data);
    if (err.warning[0] != '\0') {
        Py_DECREF(pixels);
        return PyErr_Format(PyExc_ValueError, "corrupt JPEG data: %s", err.warning);
    }
    if (exact)
        return pixels;
    return Py_BuildValue("(Nkkkk)", pixels, (unsigned long)(y0 + cut.dy / scale), (unsigned long)(xoffset + cut.dx / scale),
                         (unsigned long)rows, (unsigned long)out_width);
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    (void)self;
    return decode(args, 0);
}

static PyObject *decode_box(PyObject *self, PyObject *args) {
    (void)self;
    return decode(args, 1);
}

PyDoc_STRVAR(size_doc,
"size(data) -> (height, width) or None\n\n"
"The size of a JPEG that decode_region can decode (RGB, YCbCr or grayscale), from its header\n"
"alone; None for anything else (CMYK, not a JPEG, a broken header).");

static PyObject *size(PyObject *self, PyObject *args) {
    Py_buffer data;
    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    cinfo.err = catch_errors(&err);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        Py_RETURN_NONE;
    }
    read_header(&cinfo, &data);
    int decodable = rgb_decodable(cinfo.jpeg_color_space);
    unsigned long height = cinfo.image_height, width = cinfo.image_width;
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    if (!decodable)
        Py_RETURN_NONE;
    return Py_BuildValue("(kk)", height, width);
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS, decode_region_doc},
    {"decode_box", decode_box, METH_VARARGS, decode_box_doc},
    {"size", size, METH_VARARGS, size_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg", "Region-of-interest JPEG decoding (libjpeg-turbo).", -1, methods,
};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
