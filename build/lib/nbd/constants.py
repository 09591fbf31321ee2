"""NBD protocol constants (values from the NBD protocol document)."""

from __future__ import annotations

import enum

NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPTION_REPLY_MAGIC = 0x0003E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF
EXTENDED_REQUEST_MAGIC = 0x21E41C71

# Largest string the protocol allows (export names, descriptions, errors).
MAX_STRING = 4096
# Largest option payload we accept before disconnecting the client.
MAX_OPTION_LENGTH = 64 * 1024
# Payload limits: what we advertise, and what we accept without considering it
# a denial of service (the spec's 2^25 portability floor).
MAX_PAYLOAD = 32 * 1024 * 1024
PREFERRED_BLOCK = 4096


class HandshakeFlag(enum.IntFlag):
    FIXED_NEWSTYLE = 1 << 0
    NO_ZEROES = 1 << 1


class ClientFlag(enum.IntFlag):
    FIXED_NEWSTYLE = 1 << 0
    NO_ZEROES = 1 << 1


class Option(enum.IntEnum):
    EXPORT_NAME = 1
    ABORT = 2
    LIST = 3
    PEEK_EXPORT = 4
    STARTTLS = 5
    INFO = 6
    GO = 7
    STRUCTURED_REPLY = 8
    LIST_META_CONTEXT = 9
    SET_META_CONTEXT = 10
    EXTENDED_HEADERS = 11


_ERR = 1 << 31


class OptionReply(enum.IntEnum):
    ACK = 1
    SERVER = 2
    INFO = 3
    META_CONTEXT = 4
    ERR_UNSUP = _ERR + 1
    ERR_POLICY = _ERR + 2
    ERR_INVALID = _ERR + 3
    ERR_PLATFORM = _ERR + 4
    ERR_TLS_REQD = _ERR + 5
    ERR_UNKNOWN = _ERR + 6
    ERR_SHUTDOWN = _ERR + 7
    ERR_BLOCK_SIZE_REQD = _ERR + 8
    ERR_TOO_BIG = _ERR + 9
    ERR_EXT_HEADER_REQD = _ERR + 10


class Info(enum.IntEnum):
    EXPORT = 0
    NAME = 1
    DESCRIPTION = 2
    BLOCK_SIZE = 3


class TransmissionFlag(enum.IntFlag):
    HAS_FLAGS = 1 << 0
    READ_ONLY = 1 << 1
    SEND_FLUSH = 1 << 2
    SEND_FUA = 1 << 3
    ROTATIONAL = 1 << 4
    SEND_TRIM = 1 << 5
    SEND_WRITE_ZEROES = 1 << 6
    SEND_DF = 1 << 7
    CAN_MULTI_CONN = 1 << 8
    SEND_RESIZE = 1 << 9
    SEND_CACHE = 1 << 10
    SEND_FAST_ZERO = 1 << 11
    BLOCK_STATUS_PAYLOAD = 1 << 12


class Command(enum.IntEnum):
    READ = 0
    WRITE = 1
    DISC = 2
    FLUSH = 3
    TRIM = 4
    CACHE = 5
    WRITE_ZEROES = 6
    BLOCK_STATUS = 7
    RESIZE = 8


class CommandFlag(enum.IntFlag):
    FUA = 1 << 0
    NO_HOLE = 1 << 1
    DF = 1 << 2
    REQ_ONE = 1 << 3
    FAST_ZERO = 1 << 4
    PAYLOAD_LEN = 1 << 5


class ReplyFlag(enum.IntFlag):
    DONE = 1 << 0


class ReplyType(enum.IntEnum):
    NONE = 0
    OFFSET_DATA = 1
    OFFSET_HOLE = 2
    BLOCK_STATUS = 5
    BLOCK_STATUS_EXT = 6
    ERROR = (1 << 15) + 1
    ERROR_OFFSET = (1 << 15) + 2


class Errno(enum.IntEnum):
    """Error values allowed on the wire (not the host's errno numbering)."""

    EPERM = 1
    EIO = 5
    ENOMEM = 12
    EINVAL = 22
    ENOSPC = 28
    EOVERFLOW = 75
    ENOTSUP = 95
    ESHUTDOWN = 108


class StateFlag(enum.IntFlag):
    """Flags of the base:allocation meta context."""

    HOLE = 1 << 0
    ZERO = 1 << 1


BASE_ALLOCATION = "base:allocation"
