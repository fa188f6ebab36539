/* What raywds's two libjpeg extensions share: errors that jump back to the caller, warnings
 * kept to fail on, and the colour spaces the region decoder turns into RGB.
 * Included by raywds/loader/_jpeg.c and raywds/data/_restarts.c (after <jpeglib.h>). */
#ifndef RAYWDS_JPEG_ERRORS_H
#define RAYWDS_JPEG_ERRORS_H

#include <setjmp.h>
#include <stdio.h>

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

/* Warnings (corrupt entropy data, a premature end of the file) are kept, to fail on: libjpeg
 * would go on and write what it made up. Trace messages (level > 0) are dropped. */
static void on_message(j_common_ptr cinfo, int level) {
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    if (level >= 0)
        return;
    cinfo->err->num_warnings++;
    if (err->warning[0] == '\0')
        (*cinfo->err->format_message)(cinfo, err->warning);
}

/* An error manager whose errors jump to err->jump and whose warnings are kept in err->warning. */
static struct jpeg_error_mgr *catch_errors(struct error_mgr *err) {
    jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->message[0] = '\0';
    err->warning[0] = '\0';
    return &err->pub;
}

/* The colour spaces the region decoder turns into RGB (not CMYK or YCCK). */
static int rgb_decodable(J_COLOR_SPACE space) { return space == JCS_YCbCr || space == JCS_GRAYSCALE || space == JCS_RGB; }

#endif
