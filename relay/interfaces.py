# -*- test-case-name: tests.test_components -*-
"""
Every seam of relay, as zope interfaces (DEVELOPERS.md "Seams are zope
interfaces"; style.md section 4).

Operators replace a component by naming a class in the config's
C{components:} section; the class is built with the built-in one's
arguments and checked with C{verifyObject} at start-up.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class IFailureClassifier(Interface):
    """
    Turns a failed upstream attempt into a L{relay.policy.failures.Verdict}.

    Pure and synchronous: no I/O, no clock. The rules are behaviour.md
    R1-R24 (groups A-C).
    """

    def classifyTransport(account, reason, endpoint):
        """
        Classify a failure that ended without any HTTP status (R1, R3, R5).

        @param account: the L{relay.base.records.Account} that was dialled.
        @param reason: the exception or L{twisted.python.failure.Failure}.
        @param endpoint: C{responses} or C{chat}.
        @return: a L{relay.policy.failures.Verdict} with C{kind="transport"},
            C{failover=True}, C{status=502}.
        """

    def classifyStatus(account, endpoint, status, headers, body, now, clientText=frozenset()):
        """
        Classify an upstream HTTP error status (R7-R16, R106).

        @param account: the L{relay.base.records.Account}.
        @param endpoint: C{responses} or C{chat}.
        @param status: the upstream status (>= 400).
        @param headers: lower-cased header name -> value (first value).
        @param body: at most 512 KiB of the error body, as bytes.
        @param now: the current time, Unix seconds (for R12 reset times).
        @param clientText: the request's own strings
            (L{relay.policy.classify.clientStrings}): a message phrase that
            only they put there never marks the account (R106).
        @return: a L{relay.policy.failures.Verdict}; a 400 naming an
            unknown or unsupported field carries C{rejectedField} (R7).
        """

    def classifyStreamFailure(account, endpoint, kind, event, detail, clientText=frozenset()):
        """
        Classify a stream failure before the first semantic output (R23).

        @param kind: C{event} (an upstream C{response.failed} or C{error}
            event), C{read_error}, C{no_terminal} or C{empty_completed}.
        @param event: the parsed event dict for C{kind="event"}, else L{None}.
        @param detail: human text for logs.
        @param clientText: the request's own strings, as for
            L{classifyStatus} (R106).
        @return: a failover L{relay.policy.failures.Verdict}, or L{None} when the
            event should be forwarded to the client unchanged.
        """

    def firstOutputTimeout(account, seconds):
        """
        The verdict for a first-output timeout (R20): status 504, marked
        safe-after-write.

        @param seconds: the timeout that expired.
        """

    def stagingOverflow(account, size):
        """
        The verdict for held-back events above the cap (R22).

        @param size: bytes held when the cap was hit.
        """

    def exhausted(verdict, endpoint):
        """
        What the client sees when failover is exhausted (R15).

        @param verdict: the last failover L{relay.policy.failures.Verdict}, or
            L{None} when there was none.
        @param endpoint: C{responses} or C{chat}.
        @return: a L{relay.base.records.ClientError}, including C{wsClose} for the
            WebSocket (R65).
        """


class IStateStore(Interface):
    """
    Shared runtime state: account cooldowns, counters and TTL'd key/values
    (sticky bindings, response owners). Memory and Redis providers.

    Every method returns a L{twisted.internet.defer.Deferred}. Times are
    Unix seconds from the store's injected clock.
    """

    def getAccountStates(accountIds):
        """
        @param accountIds: an iterable of account ids.
        @return: Deferred firing with C{{id: AccountRuntime}} for every id
            (a default L{relay.state.runtime.AccountRuntime} when none is stored).
        """

    def markAccount(accountId, kind, until, reason, model=None):
        """
        Set one runtime state (R4, R11, R12).

        @param kind: C{temp_unschedulable}, C{rate_limited}, C{overloaded},
            C{disabled} or C{model_block}.
        @param until: Unix seconds (ignored for C{disabled}).
        @param reason: sanitised text.
        @param model: the upstream model for C{model_block}.
        @return: Deferred firing with L{None}.
        """

    def clearAccount(accountId):
        """
        Lift every runtime state of the account (admin "clear"): its
        cooldowns, rate limit, overload, disabled state, model blocks, R11
        transient streaks and its R11 403 counter.

        @return: Deferred firing with L{None}.
        """

    def bumpStreak(accountId, model, ttl):
        """
        Count one more consecutive transient failure of (account, model)
        (the R11 API-key transient streak). A streak whose last failure is
        more than C{ttl} seconds old starts again at 1.

        @param model: the upstream model, or C{*} when unknown.
        @param ttl: seconds the streak lives from its last failure.
        @return: Deferred firing with the new count (int).
        """

    def resetStreak(accountId, model):
        """
        End the (account, model) streak (a success, R11).

        @return: Deferred firing with L{None}.
        """

    def incrementCounter(name, ttl, refresh=True):
        """
        Increment a named counter.

        @param ttl: seconds the counter lives.
        @param refresh: L{True} resets the TTL on every increment ("from the
            last failure"); L{False} sets it only when the counter is created
            (a fixed window).
        @return: Deferred firing with the new value (int).
        """

    def resetCounter(name):
        """
        Delete a counter. @return: Deferred firing with L{None}.
        """

    def getValue(key):
        """
        @return: Deferred firing with the stored string, or L{None}.
        """

    def setValue(key, value, ttl):
        """
        Store a string with a TTL in seconds.

        @return: Deferred firing with L{None}.
        """

    def touchValue(key, ttl):
        """
        Refresh a key's TTL (a sticky hit, R38). @return: Deferred.
        """

    def deleteValue(key):
        """
        @return: Deferred firing with L{None}.
        """


class IAccountStateView(Interface):
    """
    An L{IStateStore} that keeps every account's runtime
    state at hand, so selection reads no state per account per turn: the
    scheduler asks for the view once per selection and looks at the few
    accounts whose state may block them (L{IAccountStates.flagged}). A
    store without it is read with C{getAccountStates} of every candidate,
    as before.
    """

    def accountStateView(accountIds):
        """
        The runtime states as of now (what C{getAccountStates} would
        return, for every id), without a per-account read.

        @param accountIds: the configured account ids (a store that mirrors
            remote state reads them all the first time, and after its
            source was reset).
        @return: Deferred firing with an L{IAccountStates}.
        """


class IAccountStates(Interface):
    """
    What L{IAccountStateView.accountStateView} gives.
    """

    def get(accountId, default=None):
        """
        @return: the account's L{relay.state.runtime.AccountRuntime}, or
            C{default} when none is stored (the default runtime: healthy).
        """

    def flagged(now):
        """
        The accounts whose stored state may make them unschedulable at
        C{now} (a superset: disabled, or a block, rate limit, overload or
        model block not yet over); every other account's stored state is
        the healthy default for scheduling.

        @param now: Unix seconds.
        @return: an iterable of account ids.
        """


NOT_NOW = object()
"""What L{ISynchronousState.valueNow} gives when only the asynchronous
C{getValue} can answer."""


class ISynchronousState(Interface):
    """
    A capability of an L{IStateStore} that lives in this process: some of
    its answers are given at once, without a Deferred, for the sticky fast
    path of selection (R38, R43 step 2; L{relay.scheduling.quick}), and
    every write it takes is done when the call returns (so relay's answers
    may be written at once, L{relay.process.app.answersAtOnce}).

    Each answer is the one the matching asynchronous call would fire with
    at the same moment. A provider's subclass that changes those
    asynchronous answers (or that stands for a remote store) must not
    provide it: declare the subclass with
    C{zope.interface.implementer_only}.
    """

    def valueNow(key):
        """
        C{getValue} answered at once.

        @return: the value, L{None} when absent or expired, or L{NOT_NOW}
            for a key only the asynchronous C{getValue} can answer.
        """

    def accountStateViewNow():
        """
        C{accountStateView} (L{IAccountStateView}) answered at once.

        @return: an L{IAccountStates}.
        """

    def touchValueNow(key, ttl):
        """
        C{touchValue} done at once (a missing or expired key stays absent).

        @param ttl: seconds.
        @return: L{None}.
        """


class ISlotLease(Interface):
    """
    One held concurrency slot.
    """

    kind = Attribute("C{account} or C{user}.")
    id = Attribute("The account id or the client key name.")
    waitedSeconds = Attribute("Seconds spent waiting before acquisition (0 on a fast try).")
    queuePosition = Attribute("Position in the FIFO queue when the wait began, or 0.")

    def release():
        """
        Give the slot back. Idempotent; never raises; local accounting is
        updated before it returns (architecture.md invariant 4).
        """

    def renew():
        """
        Refresh the lease TTL of a long turn (R34). @return: Deferred.
        """


class ISlotAdmission(Interface):
    """
    Per-account and per-key concurrency slots with FIFO wait queues
    (behaviour.md group D, R-B2).
    """

    def tryAcquire(kind, id, limit):
        """
        One immediate attempt.

        @param kind: C{account} or C{user}.
        @param limit: the slot limit; <= 0 means unlimited.
        @return: Deferred firing with an L{ISlotLease} or L{None}.
        """

    def acquire(plan, cancel, deadline=None):
        """
        Fast try, then join the FIFO queue and wait (R27, R30, R33).

        @param plan: the L{relay.base.records.WaitPlan}.
        @param cancel: the turn's L{relay.base.records.CancelSignal}.
        @param deadline: an absolute Unix time that bounds only this wait
            (R33), or L{None}.
        @return: Deferred firing with an L{ISlotLease}, or failing with
            L{relay.base.records.AdmissionError} (C{queue_full}, C{timeout},
            C{client_gone}, C{error}). A slot obtained after the deadline
            or cancellation is released, never returned.
        """

    def load(kind, ids):
        """
        @return: Deferred firing with C{{id: (inUse, waiting)}}.
        """


class ISynchronousAdmission(Interface):
    """
    A capability of an L{ISlotAdmission} that lives in this process: an
    immediate slot try answered without a Deferred (the sticky fast path
    of selection, R43 step 2), and releases done when the call returns (so
    relay's answers may be written at once, L{relay.process.app.answersAtOnce}).
    The same rule as L{ISynchronousState}'s holds for subclasses.
    """

    def tryAcquireNow(kind, id, limit):
        """
        C{tryAcquire} answered at once (R-B2: refused while others wait).

        @param kind: C{account} or C{user}.
        @param limit: the slot limit; <= 0 means unlimited.
        @return: an L{ISlotLease} or L{None}.
        """


class IUpstreamResponse(Interface):
    """
    An upstream HTTP response whose body has not been read yet.
    """

    code = Attribute("The HTTP status, an int.")
    headers = Attribute("Lower-cased header name -> first value, a dict of str.")

    def deliverBody(protocol):
        """
        Stream the body into an L{twisted.internet.interfaces.IProtocol}
        (its transport is an L{IPushProducer} for backpressure).
        """

    def readBody(limit):
        """
        Read at most C{limit} bytes of the body.

        @return: Deferred firing with bytes.
        """

    def abort():
        """
        Drop the connection (client gone, timeout). Idempotent.
        """


class IUpstreamDialer(Interface):
    """
    Dials upstream accounts: HTTP through treq, WebSocket through
    autobahn, each through the account's proxy.

    Never retries by itself (architecture.md invariant 3).
    """

    def request(account, method, path, body, headers, timeouts):
        """
        Send one HTTP request upstream and wait for the response headers.

        @param account: the L{relay.base.records.Account}; its base URL, auth
            headers and proxy apply.
        @param method: C{b"POST"} or C{b"GET"}.
        @param path: path under the account's base URL, e.g. C{/responses}.
        @param body: the request body, bytes, or L{None}.
        @param headers: extra headers (str -> str) copied from the client;
            the dialer adds authentication and never lets the client's
            credentials through.
        @param timeouts: L{relay.base.records.UpstreamSettings}.
        @return: Deferred firing with an L{IUpstreamResponse}; fails with
            the transport exception (refused, DNS, TLS, reset) or
            L{relay.upstream.http.HeaderTimeout}.
        """



class IPiecesDialer(IUpstreamDialer):
    """
    A capability of an L{IUpstreamDialer}: its C{request} also takes a
    body as a list of bytes-like pieces (the body is their concatenation),
    and sends them without joining them (a Codex history spliced from the
    client's bytes, L{relay.wire.rawjson.RawObject.splice}, is never
    copied whole). A dialer that does not provide it gets C{bytes}.
    """

class IAccountScheduler(Interface):
    """
    Chooses an account for a turn (behaviour.md group E): the
    C{previous_response_id} layer, then the sticky session, then load
    balance, with compatibility checks and a truthful decision record.
    """

    def select(turn, excluded):
        """
        Pick an account and try its slot.

        @param turn: the L{relay.base.records.Turn}.
        @param excluded: account ids excluded in this turn (a frozenset).
        @return: Deferred firing with a L{relay.scheduling.selection.Selection}
            (C{lease} set when the slot is held, else C{waitPlan} set), or
            failing with L{relay.scheduling.selection.NoAccountAvailable} carrying the
            L{relay.base.records.ClientError} (R44).
        """

    def bind(turn, account):
        """
        Write the sticky session binding after admission (R38).
        @return: Deferred.
        """

    def unbind(turn):
        """
        Drop the sticky binding (rotate transport policy, R72).
        @return: Deferred.
        """

    def recordResponse(turn, responseId, account):
        """
        Remember which account owns a response (R39).
        @return: Deferred.
        """


class ITurnSink(Interface):
    """
    Where the turn engine writes: SSE, JSON or WebSocket frames
    (architecture.md "The turn and the sink").
    """

    committed = Attribute("True once anything that fixes the response was sent to the client.")

    def keepalive():
        """
        Tell a waiting client we are alive (R31). SSE: commits 200 + the
        SSE headers and writes C{:} and a blank line; others: nothing.
        """

    def commit(headers):
        """
        First output: fix the response. SSE writes 200 and the SSE headers
        (plus C{headers}, e.g. C{x-codex-turn-state}); others may no-op.

        @param headers: upstream headers to pass on (str -> str).
        """

    def writeEvent(event):
        """
        Write one upstream event (L{relay.wire.sse.Event}) to the client.
        """

    def writeBody(status, headers, body):
        """
        Answer a non-streaming turn with one complete body (bytes).
        """

    def fail(error):
        """
        End the turn with a L{relay.base.records.ClientError}: before commit an
        HTTP error (JSON envelope) or WebSocket error/close; after commit a
        terminal C{response.failed} (R17) or C{error} event.
        """

    def finish():
        """
        End a successful turn.
        """


class IUsageStore(Interface):
    """
    Hourly token totals, kept where the runtime settings
    are: SQLite embedded, Redis when several relays share state. Rows are
    keyed by (hour, client key name, account id, upstream model); values
    are L{relay.usage.tokens.TokenCounts}. Hours are Unix seconds at the
    start of a UTC hour.
    """

    def add(rows):
        """
        Add to the stored totals (an increment, never a replacement).

        @param rows: a list of C{((hour, key, account, model), TokenCounts)}.
        @return: a L{Deferred} firing with L{None} once stored; on failure
            nothing may be assumed stored (the caller keeps the rows).
        """

    def totals(since, groupBy):
        """
        Sum the totals of every hour at or after C{since}.

        @param since: Unix seconds (rounded down to the hour).
        @param groupBy: C{key}, C{account}, C{model} or C{hour}.
        @return: a L{Deferred} firing with a C{dict} of group value (an
            C{int} hour for C{hour}, else a C{str}) -> C{TokenCounts}.
        """

    def series(since, until, bucket, groupBy, filters):
        """
        The totals of the hours in C{[since, until)}, summed per time
        bucket and group, in one aggregated read (the usage charts).

        @param since: Unix seconds (rounded down to the hour).
        @param until: Unix seconds (exclusive).
        @param bucket: the bucket width in seconds, a multiple of 3600
            (3600 or 86400); buckets start at multiples of it (UTC).
        @param groupBy: C{key}, C{account}, C{model} or C{none} (one group,
            C{""}).
        @param filters: a C{dict} of C{key}/C{account}/C{model} -> the exact
            value rows must have (absent: any).
        @return: a L{Deferred} firing with a C{dict} of C{(bucket start,
            group value)} -> C{TokenCounts}.
        """

    def budgetTotals(dayStart, monthStart):
        """
        Total tokens (input + output) per key since the start of the UTC
        day and of the UTC month, for token budgets.

        @param dayStart: Unix seconds of 00:00 UTC today.
        @param monthStart: Unix seconds of 00:00 UTC on the 1st.
        @return: a L{Deferred} firing with C{(day, month)}, each a C{dict}
            of key name -> tokens.
        """

    def costTotals(dayStart, monthStart):
        """
        Total cost (nano-dollars, priced turns only) per key since the
        start of the UTC day and of the UTC month, for money budgets.

        @param dayStart: Unix seconds of 00:00 UTC today.
        @param monthStart: Unix seconds of 00:00 UTC on the 1st.
        @return: a L{Deferred} firing with C{(day, month)}, each a C{dict}
            of key name -> nano-dollars.
        """


class IBudgetHolds(Interface):
    """
    Budget reservations (behaviour.md R108; L{relay.usage.holds}): what
    the turns of a key with a token or money budget hold from admission to
    their end, shared by every process that shares state. Amounts are
    whole tokens (unit C{t}) and nano-dollars (unit C{n}).
    """

    def reserve(key, holdId, tokens, nanos, limits, ttl):
        """
        Atomically check C{key}'s budgets and, when every one has room,
        hold C{tokens} and C{nanos} under C{holdId} for at most C{ttl}
        seconds. A limit has room while C{limit - max(known, settled) -
        outstanding > 0}, where C{settled} is what L{settle} added for its
        period and C{outstanding} the sum of the key's live holds of its
        unit (the new hold's own amount is not part of the check: a small
        budget still serves one turn).

        @param key: the client key's name.
        @param holdId: a unique id of the turn's hold.
        @param tokens: tokens to hold.
        @param nanos: nano-dollars to hold.
        @param limits: C{(name, period, unit, limit, known)} tuples: the
            budget's name (C{daily_usd}), its period id (C{d:<day start>}),
            C{t} or C{n}, the budget and the spend the caller knows of.
        @param ttl: seconds until the hold expires by itself.
        @return: a L{Deferred} firing with L{None} when held, else with
            C{(name, used)} of the first limit without room (nothing held).
        """

    def settle(key, holdId, tokens, nanos, periods):
        """
        The turn ended with real C{tokens} and C{nanos}: drop its hold (if
        still there) and add them to the settled amounts of C{periods}.

        @param periods: C{(period id, ttl seconds)} pairs.
        @return: a L{Deferred} firing with L{None}.
        """

    def release(key, holdId):
        """
        Drop a hold without counting anything (refused, or failed before
        output).

        @return: a L{Deferred} firing with L{None}.
        """

    def outstanding(key):
        """
        @return: a L{Deferred} firing with C{(tokens, nanos)} the key's
            live holds hold.
        """

    def rememberChain(responseId, tokens, ttl):
        """
        Keep a response's input + output tokens for C{ttl} seconds: a turn
        chained on it by C{previous_response_id} holds them too (R108).

        @return: a L{Deferred} firing with L{None}.
        """

    def chainTokens(responseId):
        """
        @return: a L{Deferred} firing with the tokens L{rememberChain} kept
            for C{responseId}, or 0.
        """


class IAccountHistory(Interface):
    """
    What each account did minute by minute over the last few minutes, kept
    in memory for the status page. Bounded: a fixed number of
    one-minute buckets per configured account, each of fixed size.
    Synchronous and cheap: the turn engine calls it on its hot path.
    """

    minutes = Attribute("How many one-minute buckets are kept (the chart's width), e.g. 15.")

    def attempt(accountId):
        """
        Count one upstream attempt (a request sent to C{accountId}).

        @param accountId: the account's id.
        """

    def failover(accountId):
        """
        Count one switch away from C{accountId} (behaviour.md section C).

        @param accountId: the account switched away from.
        """

    def firstOutput(accountId, seconds):
        """
        Record one turn's time from its start to its first output, for the
        turn's final account.

        @param accountId: the account that produced the output.
        @param seconds: the latency in seconds (not milliseconds).
        """

    def snapshot():
        """
        The last L{minutes} minutes, oldest first, ending with the current
        (partial) minute.

        @return: a JSON-ready dict: C{minutes}, C{bucket_seconds} (60),
            C{start} (Unix seconds of the oldest bucket's start) and
            C{accounts}: account id -> C{{"requests": [int],
            "failovers": [int], "first_output_p50_ms": [float or None]}},
            each list L{minutes} long.
        """


class ICredentialSource(Interface):
    """
    The bearer each account is dialled with: an API key's static
    key, or an OAuth account's current access token, refreshed before it
    expires and once after an upstream 401 (protocol.md 7.4, behaviour.md
    R11). The engine asks it for the account to dial; dialers read that
    account's C{credential} as before.
    """

    def current(account):
        """
        The account as it must be dialled now.

        @param account: a configured L{relay.base.records.Account}.
        @return: C{account} itself when nothing changed (API keys, static
            OAuth tokens), else an equal account whose C{credential} is the
            current access token and whose C{refresh_token} tells whether a
            refresh is possible (never logged).
        """

    def ready(account):
        """
        Make sure C{account} has a usable bearer before a dial: an access
        token that is missing, expired or invalidated is refreshed first
        (single flight).

        @return: L{None} when the current bearer is usable now (the common
            case, no allocation), else a L{twisted.internet.defer.Deferred}
            firing with L{True} or L{False} (whether a usable token is now
            in place) once the refresh has ended; it never fails.
        """

    def canRefresh(account):
        """
        @return: whether an upstream 401 on C{account} may be answered with
            one refresh and a replay (an OAuth account with a refresh token
            that is neither in doubt nor in C{needs_login}).
        """

    def refresh(account, stale=None, reason="401", force=False):
        """
        Refresh C{account}'s tokens: at most one refresh per account at a
        time in this process and, with a shared store, across processes.
        Callers that arrive while one runs share its outcome.

        @param stale: the access token the caller saw fail, or L{None}; when
            the current token is already another one, nothing is sent.
        @param reason: C{401}, C{proactive}, C{expired}, C{admin}, for logs.
        @param force: refresh even when the current token is still fresh
            (the admin API).
        @return: a L{twisted.internet.defer.Deferred} firing with L{True}
            when a token newer than C{stale} is in use, else L{False}
            (needs login, in doubt, transient failure); it never fails.
        """

    def invalidate(account):
        """
        Forget that the current access token works (behaviour.md R11: a
        401 after a refresh and a replay); the next dial refreshes first.
        """

    def blockReason(account, now):
        """
        Whether token state keeps C{account} from being scheduled.

        @param now: Unix seconds.
        @return: L{None}, or C{(reason, until)} like
            L{relay.state.runtime.AccountRuntime.unschedulable} (C{until} 0 for
            C{needs_login}, which lasts until new tokens arrive).
        """

    def view(account):
        """
        @return: the token state for C{/admin/accounts}: a dict with
            C{token_status}, C{token_reason}, C{token_expires_at},
            C{last_refresh}, C{refresh_failures}, C{refresh_last_error},
            C{refreshes} (times in Unix seconds; never a secret); only
            C{token_status} C{"loading"} (and C{token_source}) while the
            record has not been read from the store yet; C{{}} for accounts
            without managed tokens.
        """


class ITokenStore(Interface):
    """
    Where the newest OAuth tokens are persisted: the SQLite
    C{database} or Redis. Writes are compare-and-set on the record's
    version; the lock gives cross-process single flight.

    Every method returns a L{twisted.internet.defer.Deferred} that fails
    when the store cannot be reached (the caller decides what that means).
    """

    def load(accountId):
        """
        @return: Deferred firing with the stored record (a JSON string), or
            L{None}.
        """

    def save(accountId, version, record, expected):
        """
        Write C{record} (a JSON string whose version is C{version}) only if
        the stored version is C{expected} (L{None}: nothing stored yet).
        Durable when the Deferred fires.

        @return: Deferred firing with L{True} when written, L{False} on a
            version conflict.
        """

    def acquireLock(accountId, owner, ttl):
        """
        Take the account's refresh lock for C{ttl} seconds unless another
        owner holds it.

        @param owner: a random string naming this holder.
        @return: Deferred firing with L{True} when taken.
        """

    def releaseLock(accountId, owner):
        """
        Give the lock back if C{owner} still holds it.

        @return: Deferred firing with L{None}.
        """


class ITokenEndpoint(Interface):
    """
    The OAuth token endpoint (protocol.md 7.4): C{POST
    {auth_base_url}/oauth/token} through the account's egress proxy.
    """

    def refresh(account, refreshToken, timeout):
        """
        Exchange a refresh token.

        @param account: the L{relay.base.records.Account} (its proxy and
            C{auth_base_url} apply).
        @param refreshToken: the single-use refresh token.
        @param timeout: seconds for the whole exchange.
        @return: Deferred firing with a L{relay.oauth.endpoint.TokenReply}
            (success, or the server's error with its status); it fails with
            L{relay.oauth.endpoint.NotSent} when the request certainly never
            reached the server, and with any other exception when it may
            have (the refresh token is then in doubt).
        """


class ILiveAccounts(Interface):
    """
    The accounts in force: the one home every consumer reads through
    (scheduler, WebSocket entry, model list, operator view), so a live
    reload changes them for all at once.

    Iterating gives the accounts in configuration order; C{len()} and
    indexing work as on a tuple.
    """

    def byId(accountId):
        """
        @param accountId: an account id.
        @return: the L{relay.base.records.Account} in force with that id, or
            L{None}.
        """

    def replace(accounts):
        """
        Put C{accounts} in force (a reload) and tell every subscriber
        what changed. Turns already running keep the account object they
        selected.

        @param accounts: the new L{relay.base.records.Account}s, ids unique.
        @return: the L{relay.process.live.AccountSetChange} (empty when
            nothing changed; subscribers are then not called).
        """

    def subscribe(listener):
        """
        Be told whenever the set changes: C{listener(change)} with an
        L{relay.process.live.AccountSetChange} (ids added, removed and
        changed; never secrets). Called synchronously after the new set is
        in force; an exception is logged and does not stop the others.
        Other components (e.g. a per-account OAuth token source) use this
        to forget or rebuild their per-account state.

        @param listener: a one-argument callable.
        @return: a no-argument callable that unsubscribes.
        """


class ISlotDrain(Interface):
    """
    An L{ISlotAdmission} that can give back everything this process holds
    when it stops (a graceful stop), so other processes sharing
    its slots (Redis) see them free at once instead of after the slot TTL.
    """

    def releaseAll(timeout):
        """
        Release every lease this process still holds and wait until the
        releases (and any outstanding wait-queue departures) have reached
        the backing store.

        @param timeout: at most this many seconds to wait for the store.
        @return: Deferred firing with the number of leases it released
            (those the turns had not released themselves); never fails.
        """


class IRateLimiter(Interface):
    """
    Per-key sliding 60-second windows of turns started and tokens used
    (C{keys[].rpm} / C{keys[].tpm}, behaviour.md R102), in memory
    or shared by every relay process on one Redis
    (L{relay.tenants.ratelimit}).

    Every method returns a L{Deferred}; decisions are
    L{relay.tenants.ratelimit.RateDecision}s.
    """

    def admit(name, rpm, tpm):
        """
        Check both windows of key C{name} and, when both allow, count one
        turn started now, atomically (two processes never both take the
        last place).

        @param name: the client key's name.
        @param rpm: its request limit, or L{None} (not counted).
        @param tpm: its token limit, or L{None}.
        @return: a L{Deferred} firing with the decision; with Redis down
            and C{fail_closed} it fails with
            L{relay.tenants.ratelimit.RateLimitUnavailable}.
        """

    def peek(name, rpm, tpm):
        """
        The same decision as L{admit} without counting anything (for
        C{/admin/explain}).

        @return: a L{Deferred} firing with the decision.
        """

    def addTokens(name, tokens):
        """
        Count the tokens (input + output) of a turn of key C{name} that
        just finished.

        @param tokens: a non-negative int.
        @return: a L{Deferred} firing with L{None}; errors are logged.
        """


class IRequestLog(Interface):
    """
    The request log: one
    L{relay.tenants.record.TurnRecord} per turn, bounded by count and age,
    searchable by the operator (L{relay.tenants.requestlog}).
    """

    def add(record):
        """
        Keep one record. Synchronous and cheap (the engine calls it once
        per turn): records are buffered and written by L{flush}.

        @param record: a L{relay.tenants.record.TurnRecord}.
        """

    def flush():
        """
        Write the buffered records and apply the bounds.

        @return: a L{Deferred} firing with L{None}; never fails (errors
            are logged and the records kept for the next flush, up to a
            bound).
        """

    sampleMaxBytes = Attribute(
        "How many bytes of a sampled turn's request and output are kept (an int).")

    def sampled():
        """
        Whether the next turn's request and output are kept in its record
        (C{request_log.sample_rate}); called once per turn by the engine.

        @rtype: L{bool}
        """

    def query(filters, limit, cursor):
        """
        The newest records matching C{filters}, newest first.

        @param filters: a L{relay.tenants.requestlog.RequestQuery}.
        @param limit: at most this many records.
        @param cursor: an opaque string from a previous answer's C{next}
            (older records), or L{None} for the newest.
        @return: a L{Deferred} firing with C{(records, next)}: a list of
            L{relay.tenants.record.TurnRecord} and the cursor of the next
            page, or L{None} when there is none.
        """

    def aggregate(since, until, bucket, groupBy, filters):
        """
        The turns of C{[since, until)} summed per time bucket and group, by
        outcome and failure kind, in one read of the range
        (L{relay.tenants.logseries}).

        @param since: Unix seconds. @param until: Unix seconds (exclusive).
        @param bucket: the bucket width in seconds (buckets start at its
            multiples).
        @param groupBy: C{key}, C{account}, C{model} or C{none}.
        @param filters: a C{dict} of C{key}/C{account} (any account
            tried)/C{model} -> the exact value.
        @return: a L{Deferred} firing with C{{(bucket start, group): {"requests",
            "completed", "failed", "client_gone", "failures": {kind: n}}}}.
        """


class ITurnObserver(Interface):
    """
    Watches turns from inside the engine (OpenTelemetry traces,
    L{relay.tracing}), through one seam: the runner asks it for an
    L{ITurnTrace} when a turn starts and tells that trace about each
    attempt and the end. With no observer the runner builds nothing.
    """

    def turnStarted(turn):
        """
        A turn begins.

        @param turn: the L{relay.base.records.Turn} (its C{headers} carry the
            client's C{traceparent}, if any).
        @return: an L{ITurnTrace} for this turn, or L{None} to skip it.
        """


class ITurnTrace(Interface):
    """
    One turn as an L{ITurnObserver} follows it. Its methods must not raise
    (the runner does not guard them) and must be cheap.
    """

    def attemptStarted(account, state):
        """
        An attempt on C{account} is about to be dialled. The trace may set
        C{turn.headers["traceparent"]} for the attempt (it goes upstream).

        @param account: the L{relay.base.records.Account}.
        @param state: the runner's per-turn state (C{attempts}, C{waited}
            seconds so far, C{switches}).
        """

    def attemptEnded(result, verdict, state):
        """
        The attempt ended and was judged.

        @param result: the L{relay.engine.pump.AttemptResult}.
        @param verdict: the L{relay.policy.failures.Verdict}, or L{None}
            for a success.
        @param state: the runner's per-turn state.
        """

    def turnEnded(outcome, status, accountId, state):
        """
        The turn is over (an attempt still open ends with it).

        @param outcome: C{completed}, C{failed}, C{client_gone},
            C{relay_cancelled} or C{error}.
        @param status: the status given to the client.
        @param accountId: the last account tried, or L{None}.
        @param state: the runner's per-turn state.
        """


class IControlStore(Interface):
    """
    What operators change while relay runs (protocol.md 7.5,
    behaviour.md R95-R97): the control plane's one store, shared by every
    relay process on the same backend (L{relay.control}).

    B{Records.} A record is a JSON object stored under a I{kind} and an
    I{id}, with a I{version} and the time it was written
    (L{relay.control.store.ControlRecord}). Kinds used today:

      - C{account}: an account added through the admin API (its file-like
        fields, secrets included: the store is as private as the token
        store, never shown);
      - C{pause}: a paused account (any source: file or admin), so a pause
        survives restarts and reloads;
      - C{login}: a pending ChatGPT login (its PKCE verifier and state, or
        its device code), single-use, gone after 10 minutes;
      - C{audit}: the admin audit trail, appended with L{append} (never a
        secret);
      - C{key}: client keys issued through the admin API, with their
        policy and the SHA-256 digest of their secret (never the secret;
        L{relay.control.keys});
      - C{key_disabled}: a key (file or admin) disabled through the API;
      - C{group}: an account group added through the API;
      - C{prices}: the admin API's prices (one record).

    A kind is any short C{[a-z_]} name: a new concept adds a kind, not a
    method. Ids are non-empty strings.

    B{Versions.} Every write gives the record a new version: a
    store-wide revision number that only grows, so a version also orders
    writes across records and kinds. L{put} and L{delete} are
    compare-and-set on the version the caller last read, so two admins (or
    two processes) editing one record cannot lose each other's change.

    B{Changes.} L{subscribe} delivers an
    L{relay.control.store.ControlChange} for every write by any process
    on the same backend: at once for this process's own writes, within a
    second for other processes' (Redis publishes on a channel; memory and
    SQLite serve one process). A change whose C{kind} is L{None} means
    "anything may have changed" (the change feed reconnected and may have
    missed some): re-read everything.

    Every method returning a L{twisted.internet.defer.Deferred} is bounded
    by a timeout on the injected clock and fails with
    L{relay.control.store.ControlStoreUnavailable} when the backend cannot
    be reached (nothing may be assumed written then).
    """

    def get(kind, id):
        """
        Read one record.

        @param kind: e.g. C{account}.
        @param id: the record's id.
        @return: a Deferred firing with the
            L{relay.control.store.ControlRecord}, or L{None}.
        """

    def list(kind):
        """
        Read every record of a kind.

        @return: a Deferred firing with a list of
            L{relay.control.store.ControlRecord}, sorted by id (records
            added with L{append} therefore come oldest first).
        """

    def put(kind, id, data, expected):
        """
        Write a record if its version is still C{expected}.

        @param data: a JSON-able C{dict} (stored as JSON; read back equal).
        @param expected: the version the caller read; L{None} when the
            record must not exist yet; L{relay.control.store.ANY} to write
            whatever is stored.
        @return: a Deferred firing with the written
            L{relay.control.store.ControlRecord} (its new version), or
            failing with L{relay.control.store.VersionConflict} (nothing
            written) when the stored version is another.
        """

    def delete(kind, id, expected):
        """
        Remove a record if its version is still C{expected}
        (L{relay.control.store.ANY}: whatever is stored).

        @return: a Deferred firing with L{True} when a record was removed,
            L{False} when there was none; failing with
            L{relay.control.store.VersionConflict} when the stored version
            is another.
        """

    def append(kind, data, keep):
        """
        Add a record under the next id of an ever-growing sequence (12
        zero-padded digits, so ids sort in the order they were added),
        keeping only the newest C{keep} records of the kind (an append-only
        log such as the audit trail).

        @param data: a JSON-able C{dict}.
        @param keep: how many records of the kind to keep (>= 1).
        @return: a Deferred firing with the new
            L{relay.control.store.ControlRecord}.
        """

    def subscribe(listener):
        """
        Be told of every change (see the class docstring). The listener is
        called with one L{relay.control.store.ControlChange}, on the
        reactor thread, after the write is durable; its exceptions are
        logged and do not stop the other listeners.

        @param listener: a one-argument callable.
        @return: a no-argument callable that unsubscribes.
        """

    def start():
        """
        Begin delivering other processes' changes (Redis: open the
        subscriber connection, reconnecting by itself). Idempotent.

        @return: a Deferred firing once the feed is listening (or at once
            where there is nothing to open); it never fails: a feed that
            cannot connect yet keeps trying and signals a resync change
            once it does.
        """

    def stop():
        """
        Stop the change feed (service stop). Idempotent.

        @return: a Deferred firing once it is closed.
        """


class IEgressClient(Interface):
    """
    One HTTP request to an OpenAI endpoint that is not a turn, through an
    account's egress proxy (behaviour.md R97: login code exchanges,
    device-code requests and polls, usage probes go through the account's
    proxy exactly as its model traffic does, never directly). TLS is
    verified like every upstream call. Each request has its own
    connection; nothing is retried.
    """

    def request(proxy, method, url, headers, body, timeout):
        """
        Send one request and read the whole (bounded) answer.

        @param proxy: the account's L{relay.base.records.ProxySpec}, or L{None}
            for an account without one (a direct connection, as its turns).
        @param method: C{GET} or C{POST}.
        @param url: the absolute C{http(s)} URL.
        @param headers: C{str -> str}, sent as given (never logged: they may
            carry a bearer).
        @param body: the request body (bytes), or L{None}.
        @param timeout: seconds for the whole exchange.
        @return: a Deferred firing with a L{relay.oauth.egress.EgressReply}
            (any status), or failing with the transport's exception
            (refused, proxy failure, TLS, timeout).
        """


class IWebhookPoster(Interface):
    """
    Where relay's alerts leave the process (L{relay.alerts.delivery}): one
    JSON POST to a webhook. The URL is a secret (it often carries a
    token): never logged, never in an exception's message the caller
    logs. Retries are the caller's.
    """

    def post(url, body, timeout):
        """
        POST one JSON body and read the (discarded) answer.

        @param url: the webhook's absolute C{http(s)} URL.
        @param body: the JSON body, bytes.
        @param timeout: seconds for the whole exchange.
        @return: a Deferred firing with the answer's HTTP status (any), or
            failing with the transport's exception (refused, TLS, timeout).
        """

    def close():
        """
        Close the kept connections (service stop).

        @return: a Deferred firing once they are closed.
        """


# The turn engine's collaborators (L{relay.engine.runner.TurnRunner}), each
# passed at construction (relay.process.app builds them in one place). Only what
# the engine calls.
# ---------------------------------------------------------------------------


class IRuntimeSettings(Interface):
    """
    The runtime settings the engine reads on every attempt, so a change
    applies without a restart (R74; L{relay.state.settings.RuntimeSettings}).
    """

    current = Attribute("The L{relay.base.records.GatewaySettings} in force now (frozen).")


class IEngineMetrics(Interface):
    """
    The counters the engine feeds (L{relay.console.metrics.RelayMetrics},
    R110).
    """

    def turnFinished(entrypoint, outcome):
        """
        Count an ended turn.

        @param entrypoint: C{http} or C{ws}.
        @param outcome: C{completed}, C{failed}, C{client_gone}, C{error}
            or C{relay_cancelled}.
        """

    def requestFinished(kind, outcome):
        """
        Count an ended request of its own kind (R87: compact,
        input_tokens, retrieve ...).
        """

    def failover(reason, accountId=None, nextAccountId=None, entrypoint=None, status=None):
        """
        A switch away from C{accountId} (R19 step 7).

        @return: the remembered entry, for L{failoverTo} once the next
            account is known.
        """

    def failoverTo(entry, nextAccountId):
        """
        The account a switch went to (L{None}: none took the turn over).
        """

    def sameAccountRetry(reason):
        """
        Count a same-account retry (R14, R13, R72).
        """

    def waitFinished(entrypoint, outcome, seconds):
        """
        Count an ended slot wait (R32) and its duration, seconds.
        """

    def firstOutput(seconds):
        """
        A turn's time to first output, seconds.
        """

    def upstreamStatus(status):
        """
        Count one upstream answer by its status (an int, or a string for
        a transport failure).
        """

    def addedLatency(seconds):
        """
        Relay's own latency for a turn: start to first dispatch less its
        waits, seconds.
        """


class IUsageLedger(Interface):
    """
    Token and money accounting and the per-key budgets (R102, R108;
    L{relay.usage.ledger.UsageLedger}).
    """

    def hasBudget(key):
        """
        Whether the key called C{key} has a token or money budget (then a
        turn reserves before it runs).
        """

    def reserve(key, tokens, nanos):
        """
        R108: reserve a turn's estimate against C{key}'s budgets.

        @param tokens: the estimated tokens.
        @param nanos: the estimated cost, nano-dollars.
        @return: a Deferred firing with C{(ClientError or None, hold or None)}.
        """

    def settle(hold, counts):
        """
        R108: a reservation settles to the turn's real usage (a
        L{relay.usage.reader.TokenCounts}).
        """

    def release(hold):
        """
        R108: give back what a reservation did not settle.
        """

    def record(key, account, model, counts):
        """
        Count C{counts} for the key, the account and the upstream model.
        Synchronous; written by the ledger's flush.
        """

    def overBudget(key, now):
        """
        @return: the R102 L{relay.base.records.ClientError} of a key over its
            budget at C{now} (seconds), or L{None}.
        """

    def chainTokens(responseId):
        """
        R108: the input + output of the turn that produced C{responseId}
        (0 when unknown or L{None}).

        @return: a Deferred firing with an int.
        """

    def rememberChain(responseId, tokens, ttl):
        """
        R108: keep C{tokens} for a turn chained on C{responseId}, for
        C{ttl} seconds.
        """


class IUsageWindows(Interface):
    """
    The upstream usage windows of OAuth accounts, read from response
    headers (L{relay.scheduling.quota.UsageWindows}).
    """

    def observeHeaders(account, headers, source="headers"):
        """
        Read the usage windows in C{headers} (lower-cased name -> value)
        of an answer from C{account}.
        """


class IKeyPolicy(Interface):
    """
    A client key's policy (R102, R109; L{relay.tenants.keypolicy.KeyPolicy}):
    what it may use, how fast, and at what price.
    """

    def allowedAccounts(key):
        """
        @return: the frozenset of account ids the key may reach, or
            L{None} for all.
        """

    def refusal(key, model, now):
        """
        R102: disabled, expired, model not allowed, money budget on an
        unpriced model.

        @return: the L{relay.base.records.ClientError}, or L{None}.
        """

    def admitRate(turn):
        """
        Count the turn in the key's C{rpm}/C{tpm} windows.

        @return: a Deferred firing with the 429 L{relay.base.records.ClientError},
            or L{None}.
        """

    def priceRefusal(key, served, body):
        """
        R109: the refusal of a turn whose served model, tier or hosted
        tool has no price (a key with a money budget), or L{None}.
        """

    def estimate(key, model, body, inputTokens, outputTokens):
        """
        R108: the most a turn may cost, nano-dollars (an int).
        """

    def countTokens(key, tokens):
        """
        Count a turn's tokens in the key's C{tpm} window.
        """


class IPriceTable(Interface):
    """
    The prices of models, tiers and hosted tools (R109;
    L{relay.tenants.prices.PriceTable}).
    """

    def priced(model, counts):
        """
        @param model: the upstream model relay asked for, or L{None}.
        @param counts: a L{relay.usage.reader.TokenCounts}.
        @return: C{counts} with its cost (nano-dollars), or marked unpriced.
        """


class IStartupGate(Interface):
    """
    R105: what a turn waits on until the stores are loaded
    (L{relay.process.readiness.StartupGate}).
    """

    def wait(names=None):
        """
        @param names: the flags to wait for, or L{None} for all.
        @return: L{None} when they are set (the common case), else a
            cancellable Deferred firing when they are.
        """


class IAccountBookkeeping(Interface):
    """
    The one writer of account state for an attempt's end (R86;
    L{relay.policy.bookkeeping.AccountBookkeeping}).
    """

    stats = Attribute(
        'Account id -> C{{"turns", "failovers", "last_error", ...}} (a dict), for the'
        " operator view.")

    outcomes = Attribute(
        "The L{relay.policy.outcomes.AttemptOutcomes}: each account's recent attempt ends,"
        " for the health the operator is shown.")

    def record(account, end, verdict, model=None, requestId="", upstreamRequestId=None):
        """
        Write what the attempt end C{end} (L{relay.policy.ends}) and its
        C{verdict} mean to C{account}'s state.

        @return: a Deferred firing with a L{relay.policy.bookkeeping.Recorded}.
        """

    def accountStats(accountId):
        """
        @return: the mutable stats dict of C{accountId} (created empty).
        """

    def clear(account):
        """
        An operator's clear of C{account}'s state.

        @return: a Deferred.
        """


class IAttempt(Interface):
    """
    One attempt of a turn on an account over a transport of its own (the
    WebSocket upstream modes, R-B; L{relay.engine.wsattempt.WebSocketAttempt}),
    called like L{relay.engine.httpattempt.attemptHTTP}.
    """

    def __call__(runner, turn, sink, account, release):
        """
        @param runner: the L{relay.engine.runner.TurnRunner}.
        @param release: a no-argument callable giving the slot back
            (called before a terminal event is written).
        @return: a Deferred firing with a L{relay.engine.pump.AttemptResult}.
        """


class IKeyUsage(Interface):
    """
    A client key's own windows, shown where Codex looks for an account's
    (behaviour.md R114; L{relay.tenants.keyusage.KeyUsage}).
    """

    def limits(key):
        """
        @param key: the L{relay.base.records.ClientKey}.
        @return: a coroutine giving its L{relay.tenants.keyusage.KeyLimits}
            (windows shortest first: percent used, length in seconds, reset
            time in Unix seconds).
        """

    def limitsNow(key):
        """
        L{limits}' answer when it needs no wait (a key without C{rpm}/C{tpm}
        windows to read), read at once; the engine reads a turn's windows
        this way first.

        @param key: the L{relay.base.records.ClientKey}.
        @return: its L{relay.tenants.keyusage.KeyLimits}, or L{None} when
            L{limits} must be awaited.
        """


class IOperatorDirectory(Interface):
    """
    The console's operators in force: the file's (config.md
    C{operators:}, read-only here) and the admin API's (kind C{operator}
    of the L{IControlStore}, so every backend -- memory, SQLite, Redis --
    and every process share them; L{relay.operators.directory}).

    Reads are synchronous (a mirror kept current by the store's change
    feed: the request intake asks at a request's headers); writes go to
    the store, compare-and-set, and fail with
    L{relay.control.web.ControlError} for a refused change.
    """

    def find(name):
        """
        @return: the operator's view C{{"name", "role", "source", "email",
            ...}} (never a hash), or L{None}.
        """

    def byEmail(value):
        """
        @return: the name of the operator whose C{email} (or, failing that,
            name) is C{value} (case-insensitive), or L{None}.
        """

    def passwordHash(name):
        """
        @return: the operator's Argon2 hash, or L{None} (unknown, or OIDC
            only).
        """

    def list():
        """
        @return: every operator's view, the file's first, each sorted by name.
        """

    def add(name, role, password, email, actor):
        """
        Add an operator (API source).

        @param password: the plain password (hashed here), or L{None} for
            an OIDC-only operator with an C{email}.
        @param actor: the L{relay.operators.roles.Principal} asking.
        @return: a Deferred firing with the new view.
        """

    def change(name, changes, actor):
        """
        Change an API operator's C{role}, C{password} or C{email}.

        @return: a Deferred firing with C{(view, revoke)}: C{revoke} says
            whether its sessions must end (a new password or a lower role).
        """

    def remove(name, actor):
        """
        Remove an API operator.

        @return: a Deferred firing with L{None}.
        """

    def start():
        """
        Read the store and follow its changes.

        @return: a Deferred firing once the first read is in.
        """


class IOperatorSessions(Interface):
    """
    Server-side console sessions (kind C{op_session} of the
    L{IControlStore}: revocable on every process; only a digest of the
    cookie is stored; L{relay.operators.sessions}).
    """

    def open(name, role, via):
        """
        @return: a Deferred firing with C{(cookie, session)}: the cookie's
            secret value (shown once) and the L{relay.operators.sessions.Session}.
        """

    def lookup(cookie):
        """
        @param cookie: the cookie's value (bytes or str).
        @return: the live L{relay.operators.sessions.Session}, or L{None}
            (unknown, expired or revoked). Synchronous.
        """

    def revoke(sessionId):
        """
        End one session.

        @return: a Deferred firing with L{None}.
        """

    def revokeOperator(name):
        """
        End every session of an operator.

        @return: a Deferred firing with how many were ended.
        """

    def start():
        """
        Read the store and follow its changes.

        @return: a Deferred firing once the first read is in.
        """
