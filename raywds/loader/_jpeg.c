/* Region-of-interest JPEG decoding with libjpeg(-turbo): decode only the rows and iMCU
 * columns a crop covers, optionally DCT-scaled by 1/2, 1/4 or 1/8.
 *
 * Rows above the crop are skipped (jpeg_skip_scanlines: entropy-decoded, not IDCT'd or
 * colour-converted), rows below it are never read, and columns outside it are not
 * IDCT'd or colour-converted (jpeg_crop_scanline). Needs libjpeg-turbo >= 1.5.1.
 *
 * raywds.loader.decode uses it when it is built and falls back to torchvision.io.decode_jpeg.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

struct error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
    char warning[JMSG_LENGTH_MAX]; /* the first warning, empty when there was none */
};

static void on_error(j_common_ptr cinfo) {
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings (corrupt entropy data, a premature end of the file) are kept: libjpeg goes on and
 * fills what it could not read with grey, so decode_region reports them as errors rather than
 * hand garbage pixels to training. Trace messages (level > 0) are dropped. */
static void on_message(j_common_ptr cinfo, int level) {
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    if (level >= 0)
        return;
    cinfo->err->num_warnings++;
    if (err->warning[0] == '\0')
        (*cinfo->err->format_message)(cinfo, err->warning);
}

/* libjpeg errors jump back to the caller's setjmp(err->jump); warnings are kept in err->warning. */
static void catch_errors(struct jpeg_decompress_struct *cinfo, struct error_mgr *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->warning[0] = '\0';
}

/* After the caller's setjmp: a decompressor over `data`, its header read. */
static void read_header(struct jpeg_decompress_struct *cinfo, const Py_buffer *data) {
    jpeg_create_decompress(cinfo);
    jpeg_mem_src(cinfo, (const unsigned char *)data->buf, (unsigned long)data->len);
    jpeg_read_header(cinfo, TRUE);
}

/* The colour spaces libjpeg turns into RGB (not CMYK or YCCK). */
static int rgb_decodable(J_COLOR_SPACE space) { return space == JCS_YCbCr || space == JCS_GRAYSCALE || space == JCS_RGB; }

/* Scanlines asked of libjpeg at once. One at a time, its upsampler and colour converter
 * do part of each call's work twice for 4:2:0 JPEGs (two output rows a chroma row): 16 rows (an
 * iMCU row of such a JPEG) decode a whole image 9% faster and a training crop's region 6% faster,
 * the same pixels. */
#define ROWS_AT_ONCE 16

static JDIMENSION floor_div(long a, long b) { return (JDIMENSION)(a / b); }
static JDIMENSION ceil_div(long a, long b) { return (JDIMENSION)((a + b - 1) / b); }

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

    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
    JSAMPROW scratch = NULL; /* exact: ROWS_AT_ONCE decoded rows, before they are cut to the box */
    catch_errors(&cinfo, &err);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "JPEG: %s", err.message);
    }
    read_header(&cinfo, &data);
    if (!rgb_decodable(cinfo.jpeg_color_space)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "JPEG colour space %d is not RGB, YCbCr or grayscale", (int)cinfo.jpeg_color_space);
    }
    if (top + height > (long)cinfo.image_height || left + width > (long)cinfo.image_width) {
        long w = cinfo.image_width, h = cinfo.image_height;
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
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
        Py_DECREF(pixels);
        return PyErr_Format(PyExc_ValueError, "JPEG: %s", err.message);
    }
    JDIMENSION out_width = cinfo.output_width;
    jpeg_destroy_decompress(&cinfo); /* the rows below the box are never decoded */
    PyBuffer_Release(&data);
    if (err.warning[0] != '\0') {
        Py_DECREF(pixels);
        return PyErr_Format(PyExc_ValueError, "corrupt JPEG data: %s", err.warning);
    }
    if (exact)
        return pixels;
    return Py_BuildValue("(Nkkkk)", pixels, (unsigned long)y0, (unsigned long)xoffset, (unsigned long)rows, (unsigned long)out_width);
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
    catch_errors(&cinfo, &err);
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
