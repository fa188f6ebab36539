def decode_region(
    data: bytes, top: int, left: int, height: int, width: int, scale: int, /
) -> tuple[bytearray, int, int, int, int]:
    """(pixels, top, left, height, width): RGB rows covering the box at 1/scale; see _jpeg.c."""

def decode_box(data: bytes, top: int, left: int, height: int, width: int, /) -> bytearray:
    """Exactly the box's RGB pixels at full size, height x width x 3, contiguous; see _jpeg.c."""

def size(data: bytes, /) -> tuple[int, int] | None:
    """(height, width) of a JPEG decode_region can decode, from its header; else None."""
