"""The client the drop-ins (packd.flash_attn, packd.hf) use when a call names none: the one set
with set_client(), else a client of $PACKD_ADDRESS (default 127.0.0.1:50051) made on first use.
Safe to share across threads: the first callers racing to make it make one between them."""
import os
import threading
from typing import Optional, Union

from packd.client import Client

_lock = threading.Lock()
_default: Optional[Client] = None


def set_client(client_or_address: Union[Client, str, None]) -> None:
    """The client used when none is passed (an address makes one; None forgets it, so the next
    call connects to $PACKD_ADDRESS again)."""
    global _default
    with _lock:
        _default = (Client(client_or_address) if isinstance(client_or_address, str)
                    else client_or_address)


def resolve(client: Optional[Client]) -> Client:
    """`client` itself, else the default client (made now if there is none)."""
    global _default
    if client is not None:
        return client
    with _lock:
        if _default is None:
            _default = Client(os.environ.get("PACKD_ADDRESS", "127.0.0.1:50051"))
        return _default
