package iptables

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// typeAddrs is the probe sets' type: single addresses, each with a
// comment (its pod's UID).
const typeAddrs = "hash:ip"

// errNoSet is the kernel saying a set does not exist.
var errNoSet = errors.New("no such set")

func ipFamily(v6 bool) uint8 {
	if v6 {
		return unix.NFPROTO_IPV6
	}
	return unix.NFPROTO_IPV4
}

// ensureAddrSet makes a hash:ip set with comments, unless it exists
// already (a create without NLM_F_EXCL is the kernel's "-exist").
func (c *ipsetClient) ensureAddrSet(name string, v6 bool) error {
	rev, err := c.revision(typeAddrs, ipFamily(v6))
	if err != nil {
		return fmt.Errorf("%s sets: %w", typeAddrs, err)
	}
	_, err = c.request(nl.IPSET_CMD_CREATE, netlink.Acknowledge|netlink.Create, "", func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, name)
		ae.String(nl.IPSET_ATTR_TYPENAME, typeAddrs)
		ae.Uint8(nl.IPSET_ATTR_REVISION, rev)
		ae.Uint8(nl.IPSET_ATTR_FAMILY, ipFamily(v6))
		ae.Nested(nl.IPSET_ATTR_DATA, func(d *netlink.AttributeEncoder) error {
			d.Bytes(nl.IPSET_ATTR_CADT_FLAGS|netlink.NetByteOrder, be32(nl.IPSET_FLAG_WITH_COMMENT))
			return nil
		})
	})
	if err != nil {
		return fmt.Errorf("creating ipset %s: %w", name, err)
	}
	return nil
}

// addrEntry encodes one address, and its comment when not empty, as the
// data of an ADD or DEL.
func addrEntry(ip netip.Addr, comment string) func(*netlink.AttributeEncoder) error {
	return func(d *netlink.AttributeEncoder) error {
		typ := uint16(nl.IPSET_ATTR_IPADDR_IPV4)
		if ip.Is6() {
			typ = nl.IPSET_ATTR_IPADDR_IPV6
		}
		d.Nested(nl.IPSET_ATTR_IP, func(a *netlink.AttributeEncoder) error {
			a.Bytes(typ|netlink.NetByteOrder, ip.AsSlice())
			return nil
		})
		if comment != "" {
			d.String(nl.IPSET_ATTR_COMMENT, comment)
		}
		return nil
	}
}

// addAddr adds an address with its comment; an address already there
// gets the new comment (no NLM_F_EXCL: the kernel's "-exist").
func (c *ipsetClient) addAddr(name string, ip netip.Addr, comment string) error {
	_, err := c.request(nl.IPSET_CMD_ADD, netlink.Acknowledge, "", func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, name)
		ae.Nested(nl.IPSET_ATTR_DATA, addrEntry(ip, comment))
	})
	if err != nil {
		return fmt.Errorf("adding %s to ipset %s: %w", ip, name, err)
	}
	return nil
}

// delAddr deletes an address; one already gone is no error.
func (c *ipsetClient) delAddr(name string, ip netip.Addr) error {
	_, err := c.request(nl.IPSET_CMD_DEL, netlink.Acknowledge, "", func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, name)
		ae.Nested(nl.IPSET_ATTR_DATA, addrEntry(ip, ""))
	})
	if err != nil {
		return fmt.Errorf("deleting %s from ipset %s: %w", ip, name, err)
	}
	return nil
}

// addrs lists a set's addresses with their comments; errNoSet when the
// set does not exist.
func (c *ipsetClient) addrs(name string) (map[netip.Addr]string, error) {
	msgs, err := c.request(nl.IPSET_CMD_LIST, netlink.Dump, "", func(ae *netlink.AttributeEncoder) {
		ae.String(nl.IPSET_ATTR_SETNAME, name)
	})
	if errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("ipset %s: %w", name, errNoSet)
	}
	if err != nil {
		return nil, fmt.Errorf("listing ipset %s: %w", name, err)
	}
	out := map[netip.Addr]string{}
	for _, m := range msgs {
		if len(m.Body) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Body[4:])
		if err != nil {
			return nil, err
		}
		for ad.Next() {
			if ad.Type() != nl.IPSET_ATTR_ADT {
				continue
			}
			ad.Nested(eachEntry(func(d *netlink.AttributeDecoder) {
				var addr netip.Addr
				var comment string
				for d.Next() {
					switch d.Type() {
					case nl.IPSET_ATTR_IP:
						addr = entryIP(d)
					case nl.IPSET_ATTR_COMMENT:
						comment = d.String()
					}
				}
				if addr.IsValid() {
					out[addr.Unmap()] = comment
				}
			}))
		}
		if err := ad.Err(); err != nil {
			return nil, fmt.Errorf("reading ipset %s: %w", name, err)
		}
	}
	return out, nil
}
