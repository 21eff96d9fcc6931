"""Image input: a request's image reference (data:, http(s)://, file://, or Anthropic's base64)
turned into a decoded RGB image, within the limits of a `MediaPolicy`."""

from config.media_config import MediaPolicy
from server.media.errors import MediaError
from server.media.load import check_image_count, image_from_base64, load_image

__all__ = ["MediaError", "MediaPolicy", "check_image_count", "image_from_base64", "load_image"]
