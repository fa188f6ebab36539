def decode_region(data: bytes, top: int, left: int, height: int, width: int, scale: int, /) -> tuple[bytearray, int, int, int, int]:
    """(pixels, top, left, height, width): the box at 1/scale in whole pixels, RGB; see _jpeg.c."""

def size(data: bytes, /) -> tuple[int, int] | None:
    """(height, width) of a JPEG decode_region can decode, from its header; else None."""
