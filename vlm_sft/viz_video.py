"""Notebook views of a sample's videos: the frames each temporal group holds, with the timestamp the prompt states.

The frames are rebuilt from the sample's own patch rows (``renderers.video.unpatchify_group``), so what is drawn is
what the vision tower receives, after sampling and resizing, not the source file.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from renderers import RenderedSample
from renderers.video import VideoSettings, unpatchify_group


def video_frames(sample: RenderedSample, settings: VideoSettings, video: int = 0) -> list[tuple[float, list]]:
    """``(timestamp, [frame, ...])`` per temporal group of the sample's ``video``-th video; each frame a
    ``[H, W, 3]`` uint8 array."""
    mm = sample.multi_modal_data
    if mm is None or video >= mm.num_videos:
        raise ValueError(f"the sample has {0 if mm is None else mm.num_videos} videos, not a video {video}")
    span = mm.videos[video]
    starts = [0, *mm.image_grid_thw.prod(-1).cumsum(0).tolist()]
    out = []
    for item, timestamp in zip(span.items, span.timestamps, strict=True):
        rows = mm.pixel_values[starts[item] : starts[item + 1]]
        _, h, w = mm.image_grid_thw[item].tolist()
        frames = unpatchify_group(rows, (h, w), settings)
        out.append((timestamp, [f.permute(1, 2, 0).numpy() for f in frames]))
    return out


def plot_video(sample: RenderedSample, settings: VideoSettings, video: int = 0, *, max_groups: int = 8) -> Figure:
    """The first frame of each temporal group (up to ``max_groups``), titled with its group's timestamp."""
    groups = video_frames(sample, settings, video)[:max_groups]
    fig = Figure(figsize=(2.2 * len(groups), 2.4))
    for k, (timestamp, frames) in enumerate(groups):
        ax = fig.add_subplot(1, len(groups), k + 1)
        ax.imshow(frames[0])
        ax.set_title(f"<{timestamp:.1f} seconds>", fontsize=9)
        ax.axis("off")
    fig.suptitle(f"video {video}: {sample.multi_modal_data.videos[video].num_groups} groups of 2 frames", fontsize=10)
    return fig
