"""Models from the Hugging Face hub, kept in HF's own cache (which honours HF_HOME).

`huggingface_hub` is imported lazily: it is only needed for hub entries, and importing it
reads HF_HUB_OFFLINE once, so tests that set the variable later still see it through
`cache.is_offline()` and `local_files_only`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelNotCachedError, ModelSourceError
from . import cache
from .registry import HubSource, ModelEntry


def cached_path(source: HubSource) -> Path | None:
    """The file in the HF cache, without touching the network; None if absent."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source.repo_id, source.filename)
    # try_to_load_from_cache returns a str path, None, or a sentinel meaning "known absent".
    return Path(found) if isinstance(found, str) else None


def pull(entry: ModelEntry, *, progress: bool = True) -> Path:
    src = entry.source
    assert isinstance(src, HubSource), entry
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    where = f"{src.repo_id}/{src.filename}"
    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return Path(hf_hub_download(src.repo_id, src.filename,
                                    local_files_only=cache.is_offline()))
    except LocalEntryNotFoundError:
        raise ModelNotCachedError(
            f"model {entry.name!r} ({where}) is not in the Hugging Face cache and could not "
            f"be downloaded. Connect to the internet and unset MINIVLLM_OFFLINE/HF_HUB_OFFLINE, "
            f"then run `minivllm models pull {entry.name}`; gated Llama repos also need "
            f"HF_TOKEN set to a token that has accepted the licence."
        ) from None
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass
        raise ModelSourceError(
            f"{src.repo_id} is gated: accept its licence on huggingface.co and set HF_TOKEN "
            f"to a token of that account, then run `minivllm models pull {entry.name}`."
        ) from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"hub repo {src.repo_id} not found (or private: set HF_TOKEN) for model "
            f"{entry.name!r}."
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelSourceError(f"downloading {where} for model {entry.name!r} failed: {e}") from e
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()
