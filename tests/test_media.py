"""Images named by chat parts (jaxllm/entrypoints/media.py) and the images of a prompt
(jaxllm/engine/multimodal.py), without a model: where an image may come from, and every
refusal naming its problem."""

from __future__ import annotations

import base64
import io

import pytest

from jaxllm.entrypoints.media import MediaPolicy, load_image

PIL = pytest.importorskip("PIL")


def _png(size=(20, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def test_data_and_local_file_urls(tmp_path):
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    assert load_image(url).size == (20, 10)
    (tmp_path / "a.png").write_bytes(_png((7, 3)))
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    assert load_image(f"file://{tmp_path}/a.png", policy).size == (7, 3)


@pytest.mark.parametrize("url, policy, words", [
    ("data:image/png;base64," + base64.b64encode(b"hello").decode(), None,
     ["not a readable image"]),
    ("data:image/png;base64,@@", None, ["not valid base64"]),
    ("data:text/plain;base64,aGk=", None, ["'text/plain'", "not an image"]),
    ("data:image/png,raw", None, ["data:<type>;base64"]),
    ("https://example.com/a.png", None, ["'example.com'", "--allowed-media-domains"]),
    ("https://example.com/a.png", MediaPolicy(allowed_media_domains=("other.org",)),
     ["'example.com'"]),
    ("file:///etc/hostname", None, ["local files are not allowed"]),
    ("file:///etc/hostname", "tmp", ["outside --allowed-local-media-path"]),
    ("ftp://x/a.png", None, ["unsupported URL scheme 'ftp'"]),
])
def test_refusals_name_the_problem(tmp_path, url, policy, words):
    policy = MediaPolicy(str(tmp_path)) if policy == "tmp" else policy or MediaPolicy()
    with pytest.raises(ValueError) as e:
        load_image(url, policy, where="image 3")
    assert str(e.value).startswith("image 3: ")
    for w in words:
        assert w in str(e.value)


def test_an_image_over_the_pixel_limit_is_too_large(monkeypatch):
    from jaxllm.entrypoints import media

    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ValueError, match="too large"):
        media.decode_image(_png((20, 10)), "image 0")


def test_prompt_images_are_checked_and_limited():
    from PIL import Image

    from jaxllm.engine.multimodal import ImageProcessor

    images = ImageProcessor(processor=None, spec=None, max_images=1)
    one = Image.new("RGB", (8, 8))
    assert images.images_of({"image": one}) == [one]
    for data, words in [({"image": [one, one]}, "at most 1"), ({"audio": one}, "'audio'"),
                        ({"image": b"png"}, "is a bytes, not a PIL.Image"),
                        ({"img": one}, "unknown multi_modal_data key 'img'")]:
        with pytest.raises(ValueError, match=words):
            images.images_of(data)
