def add_restarts(data: bytes, /) -> bytes | None:
    """The JPEG rewritten losslessly with restart markers; None for CMYK/YCCK/12-bit; see _restarts.c."""
